"""torchrun entry point that runs several jobs in one launch, each in a fresh process forked from this worker.

    torchrun --nproc-per-node N _batch_worker.py BATCH.json

``BATCH.json``: ``{"preload": [module, ...], "out": DIR, "jobs": [{"name", "argv", "port", "timeout"}, ...]}``.
Each rank imports the ``preload`` modules once (torch and megatron-core: most of a job's start-up cost), then for
each job forks a child that runs ``argv`` as ``python ARGV...`` would (``-m module args...`` or ``script args...``)
and waits for it. The children of one job on every rank form that job's own process group: ``MASTER_PORT`` is the
job's port and rank 0's child hosts the store (torchrun's agent store served the launch, not the jobs), so every job
starts from the state a fresh ``torchrun`` launch of it would have, without the imports. A job that fails, hangs
past its ``timeout`` (its child is killed) or dies is recorded and the next job runs; ``DIR/rank{R}.jsonl`` gets one
line per job: ``{"name", "rank", "rc", "seconds"}`` (rc -9: killed at the timeout), ``DIR/{name}.rank{R}.log`` its
output (``/`` in a name becomes ``_``).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import signal
import sys
import time
import traceback
from pathlib import Path


def _run_job(argv: list[str], port: int, log: Path) -> int:
    """In the forked child: run ``argv`` as ``python argv...`` would, its output to ``log``; returns the exit code."""
    os.environ.update(MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="False")
    os.setpgid(0, 0)  # the job's own group: a timeout kills whatever it started
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def log_of(out: Path, name: str, rank: int) -> Path:
    return out / f"{name.replace('/', '_')}.rank{rank}.log"


def _wait(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return -9
        time.sleep(0.05)


def main() -> None:
    batch = json.loads(Path(sys.argv[1]).read_text())
    for name in batch.get("preload", []):
        importlib.import_module(name)
    rank = int(os.environ["RANK"])
    out = Path(batch["out"]) / f"rank{rank}.jsonl"
    for job in batch["jobs"]:
        sys.stdout.flush()
        sys.stderr.flush()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:  # the job's process: it ends as a process of its own would (atexit handlers, e.g. the
            # multiprocessing children a checkpoint writer started, are cleaned up by the interpreter's exit)
            raise SystemExit(_run_job(job["argv"], job["port"], log_of(Path(batch["out"]), job["name"], rank)))
        rc = _wait(pid, job["timeout"])
        with open(out, "a") as f:
            f.write(json.dumps({"name": job["name"], "rank": rank, "rc": rc,
                                "seconds": round(time.monotonic() - start, 2)}) + "\n")


if __name__ == "__main__":
    main()
