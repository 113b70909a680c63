"""``benchmarks/gpu_acceptance.sh`` without a GPU: its options, and every step's code on tiny CPU shapes.

The GPU run itself needs an H100 / H200 (nothing is measured here). What is checked: ``--help`` documents the
command and the wheel download, bad arguments are refused, without CUDA the script says so and exits 2, and
``--cpu-smoke`` runs the correctness checks (Triton interpreter), the kernel benchmark's code, the Megatron step
benchmark on a real (tiny, bf16) megatron-core GPT and the loss-hook check, writes the JSON files and the summary,
and exits 1 exactly when a correctness check failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.sh"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_unknown_arguments_and_no_cuda(tmp_path):
    res = _run("--help")
    assert res.returncode == 0
    for text in ("--cpu-smoke", "pip download", "megatron-core==0.16.1", "liger-kernel", "Exit status"):
        assert text in res.stdout, text
    assert _run("--bogus").returncode == 64
    import torch

    if not torch.cuda.is_available():
        res = _run("--out", str(tmp_path))
        assert res.returncode == 2 and "CUDA is not available" in res.stdout


@pytest.mark.slow
def test_cpu_smoke_runs_every_step_and_exits_1_exactly_on_a_correctness_failure(tmp_path):
    res = _run("--cpu-smoke", "--out", str(tmp_path), timeout=900)
    report = (tmp_path / "gpu_acceptance.md").read_text()
    for section in ("## correctness", "## logprob_kernel_bench", "## megatron_step", "## loss_hook_1m_tokens",
                    "## summary", "### correctness", "### log-prob kernels", "### Megatron step"):
        assert section in report, (section, res.stdout[-3000:])
    corr = json.loads((tmp_path / "correctness.json").read_text())
    assert set(corr["checks"]) == {"logprobs", "output_layer", "fp32_head"}
    assert all("crashed" not in c["failures"] for c in corr["checks"].values()), corr
    assert "logprobs" not in corr["failed"] and "fp32_head" not in corr["failed"], corr["failed"]
    step = json.loads((tmp_path / "megatron_step.json").read_text())
    assert all("error" not in v for v in step["variants"].values()), step["variants"]
    assert {"plain", "hook alg0", "hook alg2", "hook alg0 fp32 head", "hook alg0 fused"} <= set(step["variants"])
    assert json.loads((tmp_path / "logprob_kernel.json").read_text())["rows"]
    failed = bool(corr["failed"]) or "logprob_kernel_bench (exit" in report
    assert res.returncode == (1 if failed else 0), (res.returncode, corr["failed"], res.stdout[-2000:])
    assert ("CORRECTNESS FAILED" in report) == failed
