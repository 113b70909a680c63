"""The sampling-support replay at TP=2 (from logits, torch and Triton kernels under the
interpreter, and from hidden states) equals TP=1 and the float64 masked
log-softmax: two real torchrun processes (gloo, CPU); the checks and their tolerances are in
``support_logprobs_tp_worker.py``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from _launch import torchrun

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 240


@pytest.mark.dist
def test_support_replay_tp2_equals_tp1_and_the_oracle(tmp_path):
    torchrun(HERE / "support_logprobs_tp_worker.py", ["--out", str(tmp_path)], timeout=LAUNCH_TIMEOUT_S,
             env={"TRITON_INTERPRET": "1"})
    n_checks = 16 + (6 if importlib.util.find_spec("triton") is not None else 0)
    for rank in (0, 1):
        checks = json.loads((tmp_path / f"rank{rank}.json").read_text())["checks"]
        assert len(checks) == n_checks, checks
        bad = {k: v for k, v in checks.items() if not v[0] <= v[1]}
        assert not bad, f"rank {rank}: [error, tolerance] above tolerance: {bad}"
