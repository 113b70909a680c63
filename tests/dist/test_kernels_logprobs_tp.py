"""The Triton log-prob / entropy kernels at TP=2: two real torchrun processes (gloo, CPU, TRITON_INTERPRET=1).

``kernels_logprobs_tp_worker.py`` runs the per-rank kernel plus the TP combination through the public
function and compares with a float64 full-vocabulary oracle and with the torch path at TP=2; here every
check of every rank must be within its tolerance (stated and justified in the worker and in
tests/test_kernels_logprobs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _launch import torchrun

HERE = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 300


@pytest.mark.dist
def test_kernels_tp2_match_the_full_vocabulary_oracle(tmp_path):
    pytest.importorskip("triton")
    torchrun(HERE / "kernels_logprobs_tp_worker.py", ["--out", str(tmp_path)], timeout=LAUNCH_TIMEOUT_S,
             env={"TRITON_INTERPRET": "1"})
    for rank in (0, 1):
        checks = json.loads((tmp_path / f"rank{rank}.json").read_text())["checks"]
        assert len(checks) == 21, checks
        bad = {k: v for k, v in checks.items() if not v[0] <= v[1]}
        assert not bad, f"rank {rank}: [error, tolerance] above tolerance: {bad}"
