"""The torchrun launcher of the distributed tests (``_launch.py``): a hanging worker fails the test within the
timeout and leaves no process behind.

torchrun starts every worker in its own session, so killing torchrun's process group alone orphans the
workers, and they keep the log pipe open (the launcher would then block reading it). The hanging worker
here also starts a grandchild in yet another session.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from _launch import torchrun

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 30.0  # long enough for torchrun (a torch import) to start both workers on a loaded machine
CLEANUP_S = 20.0  # the launcher's own work after the timeout: kill, reap, read the log


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_timeout_kills_every_worker_and_returns(tmp_path):
    outcome: list[BaseException | str] = []

    def launch():
        try:
            torchrun(HERE / "hang_worker.py", ["--out", str(tmp_path)], nproc=2, timeout=TIMEOUT_S,
                     what="hanging workers")
            outcome.append("returned")
        except BaseException as e:  # pytest.fail raises a BaseException
            outcome.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S + CLEANUP_S)
    elapsed = time.monotonic() - start
    pids = [int(p) for f in sorted(tmp_path.glob("pids*")) for p in f.read_text().split()]
    try:
        assert len(pids) == 4, f"the workers did not start within {TIMEOUT_S} s (pid files: {pids})"
        assert not thread.is_alive(), f"the launcher still blocks {elapsed:.0f} s after a {TIMEOUT_S} s timeout"
        assert len(outcome) == 1 and isinstance(outcome[0], pytest.fail.Exception), outcome
        assert "timed out" in str(outcome[0])
        deadline = time.monotonic() + 5.0  # SIGKILL is asynchronous: give the kernel a moment
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in pids if _alive(p)], "processes of the launch survived its timeout"
    finally:  # never leave a hanging process behind, whatever the launcher did
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
