"""The Triton log-prob / entropy kernels at TP=2: two real torchrun processes (gloo, CPU, TRITON_INTERPRET=1).

``kernels_logprobs_tp_worker.py`` runs the per-rank kernel plus the TP combination through the public
function and compares with a float64 full-vocabulary oracle and with the torch path at TP=2; here every
check of every rank must be within its tolerance (stated and justified in the worker and in
tests/test_kernels_logprobs.py).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
LAUNCH_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.dist
def test_kernels_tp2_match_the_full_vocabulary_oracle(tmp_path):
    pytest.importorskip("triton")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(HERE / "kernels_logprobs_tp_worker.py"), "--out", str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun timed out after {LAUNCH_TIMEOUT_S} s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    for rank in (0, 1):
        checks = json.loads((tmp_path / f"rank{rank}.json").read_text())["checks"]
        assert len(checks) == 21, checks
        bad = {k: v for k, v in checks.items() if not v[0] <= v[1]}
        assert not bad, f"rank {rank}: [error, tolerance] above tolerance: {bad}"
