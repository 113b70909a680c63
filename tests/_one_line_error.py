"""A command-line entry point refuses bad input with exit status 2 and one readable stderr line."""

from __future__ import annotations

from collections.abc import Callable


def assert_one_line_error(capsys, main: Callable[[list[str]], int], argv: list[str], *needles: str) -> str:
    """``main(argv)`` returns 2 and writes one stderr line (no traceback) holding every needle; returns it."""
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, (rc, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err
