"""One torchrun launch for the distributed tests: a free loopback port, a timeout that kills the whole
process tree (a hang fails the test, it never blocks CI), and the tail of the log on failure.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group never
reaches them: on timeout torchrun is stopped first (it cannot start or restart workers any more), then
every descendant, found through the parent links while they still exist, is killed with its own process
group, and the log pipe the workers held is closed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, every descendant (in whatever session) and their process groups."""
    try:
        root = psutil.Process(pid)
        root.suspend()  # no new worker (torchrun restarts failed ones) while the tree is listed
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    own_group = os.getpgrp()
    for proc in tree:
        try:
            group = os.getpgid(proc.pid)
            if group != own_group:  # never the test process's own group
                os.killpg(group, signal.SIGKILL)
            proc.kill()
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass


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
        try:
            log, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process outside the tree (a double fork) still holds the pipe
            proc.kill()
            proc.stdout.close()
            proc.wait()
            log = "(log unavailable: a process outside the launch's tree kept its output pipe open)"
        pytest.fail(f"{what} timed out after {timeout} s:\n{log[-4000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (rc={proc.returncode}):\n{log[-6000:]}")
    return log
