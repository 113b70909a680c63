"""One rank's training call raises and its process ends: the other rank says which rank failed, where and
why, instead of only the backend's "Connection closed by peer" (2 processes of one gloo job;
``rank_failure_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from _launch import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TIMEOUT_S = 150

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_survivor_names_the_rank_that_failed_and_where(tmp_path):
    # Two worker processes of one gloo job, started directly (rank 0 hosts the job's store, as a torchrun agent
    # would). A single torchrun agent stops its other workers at its next check once one fails, at a moment
    # no test controls; a rank on another node, under its own agent, goes on: that is the case modelled here.
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": "2"}  # PYTHONPATH: tests/conftest.py
        procs.append(subprocess.Popen([sys.executable, str(HERE / "rank_failure_worker.py"), "--out", str(tmp_path)],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            for q in [*psutil.Process(p.pid).children(recursive=True), psutil.Process(p.pid)]:
                q.kill()
        pytest.fail("rank failure job timed out:\n" + "\n".join(p.communicate()[0][-2000:] for p in procs))
    log = logs[1]
    assert procs[1].returncode != 0, "rank 1's error must end its process"
    assert procs[0].returncode == 0, logs[0][-4000:]
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
