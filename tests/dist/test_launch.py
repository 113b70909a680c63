"""The torchrun launcher of the distributed tests: a hanging launch fails within its timeout and leaves no worker
behind (torchrun starts its workers in sessions of their own; killing torchrun's process group alone orphaned
them, and their open log pipe kept ``communicate()`` blocked: a hang blocked CI)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _launch import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist]


@pytest.mark.timeout(150)
def test_hanging_launch_fails_and_kills_every_worker(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 20"):
        torchrun(HERE / "hang_worker.py", [str(tmp_path)], nproc=2, timeout=20, what="hanging launch")
    assert time.monotonic() - t0 < 110
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"workers {alive} outlived the launch"
