"""One torchrun launch for the distributed tests: a free loopback port, a timeout that kills torchrun and every
worker below it (a hang fails the test, it never blocks CI), and the tail of the log on failure."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process below it. torchrun starts its workers in sessions of their own, so
    killing torchrun's process group alone orphans them (and they keep the log pipe open): the descendants are
    listed first, while torchrun still parents them, then everything is killed."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: Path | list[str],
    args: list[str],
    *,
    nproc: int = 2,
    timeout: float,
    env: dict | None = None,
    what: str = "torchrun",
) -> str:
    """Run ``torchrun --nproc-per-node nproc script *args`` from the repository root; return its log.

    ``script`` is a script path, or torchrun's own entry words such as ``["-m", "examples.rl.train"]``.

    ``env`` adds to the environment (``OMP_NUM_THREADS=1`` and ``PYTHONWARNINGS=ignore`` are always set).
    Fails the calling test when the launch times out or exits non-zero.
    """
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        *([str(script)] if isinstance(script, Path) else script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        log, _ = proc.communicate(timeout=60)
        pytest.fail(f"{what} timed out after {timeout} s:\n{log[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (rc={proc.returncode}):\n{log[-6000:]}")
    return log
