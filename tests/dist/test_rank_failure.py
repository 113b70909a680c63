"""One rank's training call raises and its process ends: the other rank says which rank failed, where and
why, instead of only the backend's "Connection closed by peer" (real torchrun, 2 processes, gloo;
``rank_failure_worker.py``)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 150
MONITOR_S = 20

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_survivor_names_the_rank_that_failed_and_where(tmp_path):
    # The agent checks its workers every MONITOR_S: rank 0 then models a rank on another node, which its own
    # agent does not stop when rank 1 ends (with torchrun's 0.1 s default a loaded machine can stop rank 0
    # before it has read the record and written its file).
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), "--monitor-interval", str(MONITOR_S),
           str(HERE / "rank_failure_worker.py"), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}  # PYTHONPATH: tests/conftest.py
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            p.kill()
        log, _ = proc.communicate()
        pytest.fail(f"rank failure launch timed out:\n{log[-4000:]}")
    assert proc.returncode != 0, "rank 1's error must fail the job"
    assert "ValueError: injected: rank 1's micro-batch is malformed" in log, log[-4000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["healthy_record"] is False  # a healthy call leaves nothing in the store
    assert r0["error"] == "RankFailedError" and r0["is_runtime_error"], r0
    where = "megatron's forward-backward schedule (the loss function included) of training call 2"
    assert r0["message"].startswith(
        f"rank 1 failed in {where}: ValueError: injected: rank 1's micro-batch is malformed; "
        f"this rank (0) then stopped in {where}: RuntimeError: "), r0["message"]
    assert "by peer" in r0["message"]  # the backend's own words stay, after the cause
    assert not (tmp_path / "rank1.json").exists()
