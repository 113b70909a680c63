"""The ``slime-tis`` console script: ``slime-tis diagnose FILE [FILE ...]`` (``slime_tis.tools.diagnose``).

Malformed input ends in one line naming the file, record and field and exit status 2 (no traceback); ``diagnose``
exits 1 when the dump holds no usable token.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

DIAGNOSE_DESCRIPTION = textwrap.fill(
    "Off-policy diagnostics of log-prob dumps (docs/dump_format.md, or slime's --save-debug-train-data files, "
    "merged): tables per percentile and response-length bucket, a recommended configuration with its reasoning, a "
    "histogram PNG of the per-token log-ratios. Exit status 2: malformed input (one line naming the file, record and "
    "field); 1: no usable token.", width=100)
CONFIG_DESCRIPTION = textwrap.fill(
    "A hypothetical correction configuration (not the dump's run) whose weights, rejections and tis/ metrics are "
    "computed on the dump's log-probs as a host would (options it ignores are named in the report). Default: "
    "algorithm 2 with token-level truncation at 2, whatever algorithm wrote the dump (an algorithm-0 dump included).",
    width=100)


def _diagnose_parser(sub: argparse._SubParsersAction) -> None:
    from slime_tis.config import ALL_OPTIONS
    from slime_tis.config_fields import add_options

    p = sub.add_parser("diagnose", help="diagnostics + recommendation from a log-prob dump",
                       description=DIAGNOSE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE",
                   help="dump file(s), .jsonl or .pt (concatenated); .pt may be slime --save-debug-train-data "
                   "files (several ranks' / rollouts' files merged; step = rollout id); a directory stands for "
                   "its dump: RUN_DIR/logprobs.jsonl of the example job, else its slime train_*.pt files")
    p.add_argument("--png", default=None,
                   help="histogram path (default: <first dump file without suffix>_logratio_hist.png)")
    p.add_argument("--no-png", action="store_true", help="do not write the histogram")
    p.add_argument("--json", default=None, help="also write every number of the report to this JSON file")
    p.add_argument("--buckets", default=None,
                   help="comma-separated response-length bucket edges, e.g. 64,256,1024 (default: quartiles)")
    p.add_argument("--steps", default=None, help="only sequences of steps A:B (inclusive A, exclusive B; open ends ok)")
    p.add_argument("--format", choices=("flags", "yaml"), default="flags",
                   help="the recommendation as command-line flags (Megatron-LM, train_rl.py, megatron-core) or as "
                   "the YAML keys of slime's --custom-config-path file (default: flags)")
    add_options(p, ALL_OPTIONS, "correction configuration to evaluate", CONFIG_DESCRIPTION)


def _parse_steps(spec: str) -> tuple[float, float]:
    try:
        a, b = spec.split(":")
        return (int(a) if a else -math.inf, int(b) if b else math.inf)
    except ValueError:
        raise ValueError(f"--steps = {spec!r}: expected A:B with integers (either may be empty)") from None


def _given_config(ns: argparse.Namespace):
    """``TISConfig.from_args`` of the options given, as a host builds it, or algorithm 2 with token truncation at 2
    when none is given."""
    from slime_tis.config import DESTS_OF, TISConfig

    given = any(getattr(ns, d, None) not in (None, False) for dests in DESTS_OF.values() for d in dests)
    if not given and not getattr(ns, "tis_preset", None):
        return TISConfig(use_tis=True)
    return TISConfig.from_args(ns)


def _diagnose(ns: argparse.Namespace) -> int:

    from slime_tis.tools.diagnose import diagnose, format_report, write_histogram
    from slime_tis.tools.dump import dump_files, read_logprob_dump

    files = dump_files(ns.files)  # a run directory: the dump files it holds
    dump = read_logprob_dump(files)
    for note in dump.notes:
        print(f"slime-tis diagnose: note: {note}", file=sys.stderr)
    if ns.steps:
        lo, hi = _parse_steps(ns.steps)
        dump = dump.select((dump.step >= lo) & (dump.step < hi))
        if dump.n_seq == 0:
            raise ValueError(f"--steps = {ns.steps!r} selects no sequence")
    edges = None
    if ns.buckets:
        try:
            edges = [int(x) for x in ns.buckets.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--buckets = {ns.buckets!r}: expected comma-separated integers") from None
    result = diagnose(dump, _given_config(ns), bucket_edges=edges)
    print(format_report(result, fmt=ns.format))
    if not ns.no_png:
        png = ns.png or str(files[0].with_suffix("")) + "_logratio_hist.png"
        n = write_histogram(dump, png)
        print(f"\nhistogram of {n} per-token log-ratios: {png}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(result.as_dict(), indent=1, allow_nan=True))
    return 0 if result.usable_tokens else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``slime-tis``; returns the process exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="slime-tis", description="rollout-correction tools for slime_tis")
    sub = parser.add_subparsers(dest="command", metavar="{diagnose}")
    _diagnose_parser(sub)
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 2
    return run_reporting_errors("slime-tis diagnose", _diagnose, ns)


def run_reporting_errors(prog: str, fn: Callable[..., int], *args: Any) -> int:
    """``fn(*args)``; bad input (``ValueError``, ``OSError``, ``MemoryError``): one line on stderr, exit status 2;
    anything else (a bug): one line and exit status 3, or the traceback with ``SLIME_TIS_TRACEBACK=1``."""
    try:
        return fn(*args)
    except (ValueError, OSError, MemoryError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - the console script never ends in a traceback unless asked to
        if os.environ.get("SLIME_TIS_TRACEBACK"):
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} (SLIME_TIS_TRACEBACK=1 shows the "
              "traceback; please report it)", file=sys.stderr)
        return 3


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    if isinstance(e, MemoryError):
        text = f"out of memory ({text})"
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
