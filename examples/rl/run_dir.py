"""One run per run directory, resumed only with its own configuration.

* **Fresh start** (no ``--resume``): ``RUN_DIR`` must be absent or empty. A non-empty one is refused,
  unless ``--overwrite``, which empties it first -- only when it is a run directory this job wrote: its
  ``args.json`` is a regular file holding a JSON object whose :data:`MARKER_KEY` is :data:`MARKER` (the
  trainer writes both at a run's first start). Any other directory -- another tool's ``args.json``, one
  that is not JSON, not an object, a symlink, an older format -- is refused in one line and left
  untouched. Otherwise a new run would empty ``metrics.jsonl``, append to the old ``logprobs.jsonl`` and
  leave old checkpoints that a later ``--resume`` would load.
* **Resume**: the configuration is the one saved in ``RUN_DIR/args.json``. Flags not given on the command
  line take their saved value; a given flag must agree with it, except the flags of
  :data:`MAY_CHANGE_ON_RESUME` (how long and how the run is executed, not what it computes). A
  contradiction is refused naming the flag and both values (an algorithm-2 run is never continued as
  algorithm 0). ``args.json`` is never rewritten by a resumed run.
* On resume, ``metrics.jsonl`` and ``logprobs.jsonl`` lose the records of the steps that will be
  repeated (steps >= the checkpoint's) and a torn last line (:func:`cut_from_step`), so the resumed run
  appends cleanly.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import stat
from collections.abc import Callable, Sequence
from typing import Any

ARGS_FILE = "args.json"
#: flags a resumed run may change; when not given they keep the saved value
MAY_CHANGE_ON_RESUME = ("steps", "save_interval", "dump_interval", "pp", "sglang_url")
#: flags of this invocation only: never read from args.json, never compared
SESSION_ONLY = ("run_dir", "resume", "overwrite", "no_progress")
#: keys args.json holds besides the flags
DERIVED_KEYS = ("algorithm", "world_size")
#: the key of args.json that marks a run directory written by this job, and its value (writer and format);
#: ``--overwrite`` empties only a directory whose args.json carries exactly this
MARKER_KEY = "run_dir_format"
MARKER = "examples.rl.train run directory, format 1"
#: an args.json larger than this is not one the trainer wrote (it holds a few hundred flags)
_MAX_ARGS_BYTES = 1 << 20


class RunDirError(ValueError):
    """The run directory cannot be used as asked (message names the directory and the flag)."""


def explicit_dests(build_parser: Callable[[], argparse.ArgumentParser], argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option given on the command line ``argv`` (defaults suppressed)."""
    probe = build_parser()
    for action in probe._actions:  # noqa: SLF001 - argparse has no public way to list actions
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_args(list(argv))))


def check_fresh(run_dir: str, *, overwrite: bool) -> None:
    """Refuse to start a new run in a non-empty ``run_dir`` (see the module docstring). Read-only: every
    rank may call it before any rank writes."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise RunDirError(f"--run-dir {run_dir!r} exists and is not a directory")
    entries = sorted(os.listdir(run_dir)) if os.path.isdir(run_dir) else []
    if not entries:
        return
    shown = ", ".join(entries[:6]) + (", ..." if len(entries) > 6 else "")
    if not overwrite:
        raise RunDirError(
            f"--run-dir {run_dir!r} is not empty ({shown}): continue that run with --resume, or start it anew "
            "with --overwrite (deletes its contents), or choose another directory"
        )
    why = _not_ours(os.path.join(run_dir, ARGS_FILE))
    if why:
        raise RunDirError(
            f"--overwrite refuses to empty {run_dir!r} ({shown}): {why}, so it is not a run directory written "
            "by this job; nothing was deleted: choose an empty directory"
        )


def _not_ours(path: str) -> str | None:
    """Why ``path`` (a run directory's args.json) is not the marked file the trainer writes, or None."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"it has no {ARGS_FILE}"
    except OSError as e:
        return f"its {ARGS_FILE} cannot be inspected ({e.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return f"its {ARGS_FILE} is not a regular file"
    if st.st_size > _MAX_ARGS_BYTES:
        return f"its {ARGS_FILE} has {st.st_size} bytes"
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        return f"its {ARGS_FILE} is not JSON ({type(e).__name__})"
    if not isinstance(saved, dict):
        return f"its {ARGS_FILE} holds a {type(saved).__name__}, not an object"
    if saved.get(MARKER_KEY) != MARKER:
        return f"its {ARGS_FILE} lacks {MARKER_KEY!r} = {MARKER!r}"
    return None


def clear(run_dir: str) -> None:
    """Delete everything inside ``run_dir`` (``--overwrite``, after :func:`check_fresh` accepted it)."""
    for name in os.listdir(run_dir):
        path = os.path.join(run_dir, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


def load_saved(run_dir: str) -> dict[str, Any]:
    """``RUN_DIR/args.json`` as a dict (a resume without it is refused: its configuration is unknown)."""
    path = os.path.join(run_dir, ARGS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except FileNotFoundError:
        raise RunDirError(
            f"--resume: {path} does not exist, so the run's configuration is unknown (a run directory holds "
            f"{ARGS_FILE} from its first start)"
        ) from None
    except (OSError, ValueError) as e:
        raise RunDirError(f"--resume: {path} cannot be read ({e})") from None
    if not isinstance(saved, dict):
        raise RunDirError(f"--resume: {path} must hold a JSON object, got {type(saved).__name__}")
    return saved


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def resolve_resume(
    args: argparse.Namespace,
    explicit: set[str],
    saved: dict[str, Any],
    resolve_config: Callable[[argparse.Namespace], Any],
) -> argparse.Namespace:
    """The namespace of a resumed run: saved values for the flags not given, given values checked.

    The example's own flags are compared one by one. The plugin's flags are compared through the resolved
    configuration ``resolve_config(ns)`` (a frozen dataclass, ``TISConfig``), so that two spellings of
    one configuration agree (``--tis-preset`` vs the flags it expands to). Raises :class:`RunDirError`
    naming every contradiction with the saved and the given value."""
    plugin = _plugin_dests()
    out = argparse.Namespace(**vars(args))
    for dest in vars(args):
        if dest not in SESSION_ONLY and dest in saved and dest not in explicit:
            setattr(out, dest, saved[dest])
    problems = []
    for dest in sorted(explicit - set(SESSION_ONLY) - plugin):
        if dest not in saved:
            continue  # a flag newer than the run's args.json: the given value is used
        was, now = saved[dest], getattr(args, dest)
        if dest == "sglang_url" and (was is None) != (now is None):
            problems.append(f"--sglang-url: the run used {was or 'the embedded engine'}, this command line "
                            f"{now or 'the embedded engine'}")
        elif dest not in MAY_CHANGE_ON_RESUME and was != now:
            problems.append(f"{_flag(dest)}: the run has {was!r}, this command line {now!r}")
    as_saved = argparse.Namespace(**{**vars(out), **{d: saved[d] for d in plugin if d in saved}})
    try:
        was_cfg, now_cfg = resolve_config(as_saved), resolve_config(out)
    except ValueError as e:
        raise RunDirError(f"--resume in {args.run_dir!r}: the configuration cannot be resolved ({e})") from None
    if was_cfg != now_cfg:
        changed = [d for d in sorted(explicit & plugin) if getattr(args, d) != saved.get(d)]
        given = [f"{_flag(d)} {getattr(args, d)!r}" for d in changed]
        diff = [f"{f.name} {getattr(was_cfg, f.name)!r} -> {getattr(now_cfg, f.name)!r}"
                for f in dataclasses.fields(was_cfg) if getattr(was_cfg, f.name) != getattr(now_cfg, f.name)]
        problems.append(f"{', '.join(given) or 'the plugin flags'} change the run's configuration ({'; '.join(diff)})")
    saved_alg, alg = saved.get("algorithm"), getattr(now_cfg, "algorithm", None)
    if saved_alg is not None and alg is not None and saved_alg != alg:
        problems.append(f"the run is algorithm {saved_alg}, this command line gives algorithm {alg}")
    if problems:
        raise RunDirError(
            f"--resume in {args.run_dir!r}: the command line contradicts the run's {ARGS_FILE}: "
            + "; ".join(problems)
            + ". A resumed run keeps its configuration (only "
            + ", ".join(_flag(d) for d in MAY_CHANGE_ON_RESUME)
            + " may change): drop the other flags, or start a new run directory"
        )
    return out


def _plugin_dests() -> set[str]:
    """The dests of the plugin's flags (``add_tis_arguments``)."""
    from slime_tis.arguments import add_tis_arguments

    parser = add_tis_arguments(argparse.ArgumentParser(add_help=False))
    return {a.dest for a in parser._actions}  # noqa: SLF001 - argparse has no public way to list actions


def write_saved(run_dir: str, args: argparse.Namespace, extra: dict[str, Any]) -> None:
    """Write ``RUN_DIR/args.json`` (fresh runs only; atomic replace), marked as this job's (:data:`MARKER`)."""
    data = {k: v for k, v in vars(args).items() if k not in ("resume", "overwrite")}
    data.update(extra)
    data[MARKER_KEY] = MARKER
    path = os.path.join(run_dir, ARGS_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


def cut_from_step(path: str, start: int) -> list[str]:
    """Truncate the JSONL file ``path`` before its first record with ``step >= start`` (records are written
    in step order; header lines without ``step`` are kept), and before a torn last line; complete a last
    line that lacks only its newline. Returns notes on what was cut (torn lines)."""
    from slime_tis.tools.jsonl import read_jsonl, torn_tail

    if not os.path.isfile(path):
        return []
    notes = []
    tail = torn_tail(path)
    if tail is not None:
        keep, why = tail
        complete = keep == os.path.getsize(path)  # a valid last line that only lacks its newline
        if not complete:
            notes.append(why)
        with open(path, "r+b") as f:
            if complete:
                f.seek(keep)
                f.write(b"\n")
            else:
                f.truncate(keep)
    read = read_jsonl(path)  # malformed lines in the middle: an error naming the file and line
    first = next((n for n, row in read.rows if isinstance(row, dict) and _step(row) >= start), None)
    if first is None:
        return notes
    offset = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if lineno == first:
                break
            offset += len(raw)
    with open(path, "r+b") as f:
        f.truncate(offset)
    return notes


def _step(row: dict[str, Any]) -> float:
    step = row.get("step")
    return step if isinstance(step, (int, float)) and not isinstance(step, bool) else float("-inf")
