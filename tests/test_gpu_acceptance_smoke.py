"""``benchmarks/gpu_acceptance.sh`` without a GPU: its options, and every step's code on tiny CPU shapes.

The GPU run itself needs an H100 / H200 (nothing is measured here). What is checked: ``--help`` documents the
command and the carried wheels, bad arguments are refused, step limits over the budget are refused, without
CUDA the script says so and exits 2; the wheel-folder check names what is wrong; ``--cpu-smoke`` runs all eight
steps (Triton interpreter, a real tiny bf16 megatron-core GPT, verl's helper, CPU stand-ins noted as such for the
libraries that need CUDA), and its summary holds every step, every method and every column, and fails naming
the column or method taken out of a step's file.
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


def _run(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_unknown_arguments_no_cuda_and_the_budget(tmp_path):
    res = _run("--help")
    assert res.returncode == 0
    for text in ("--cpu-smoke", "gpu_wheels.sh", "pip download", "megatron-core==0.16.1", "liger-kernel==0.8.5",
                 "cut-cross-entropy==25.1.1", "verl==0.9.1", "Exit status"):
        assert text in res.stdout, text
    assert _run("--bogus").returncode == 64
    res = _run("--cpu-smoke", "--out", str(tmp_path), env={"GPU_ACCEPTANCE_BUDGET_S": "300"})
    assert res.returncode == 64 and "over the budget" in res.stderr, res.stderr  # limits must fit the budget
    import torch

    if not torch.cuda.is_available():
        res = _run("--out", str(tmp_path))
        assert res.returncode == 2 and "CUDA is not available" in res.stdout


def test_wheel_folder_check_names_what_is_wrong(tmp_path):
    """The carried-set check: a missing wheel, a compiled wheel where a pure one belongs, an unexpected one."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import _third_party as tp

    assert any(p.startswith("missing: megatron-core==0.16.1") for p in tp.check_wheels(tmp_path))
    import zipfile

    def wheel(name: str, requires: str) -> None:
        with zipfile.ZipFile(tmp_path / name, "w") as z:
            z.writestr(name.split("-")[0] + ".dist-info/METADATA", f"Name: x\nRequires-Dist: {requires}\n")

    wheel("liger_kernel-0.8.5-cp312-cp312-manylinux_2_28_x86_64.whl", "triton>=2.3.1")
    wheel("cut_cross_entropy-25.1.1-py3-none-any.whl", "torch>=2.12")
    wheel("flash_attn-2.0-py3-none-any.whl", "torch")
    problems = "\n".join(tp.check_wheels(tmp_path))
    assert "liger_kernel-0.8.5-cp312-cp312-manylinux_2_28_x86_64.whl: not a pure wheel" in problems, problems
    assert "requires torch>=2.12, the image has torch 2.11.0" in problems, problems
    assert "unexpected wheel (not in the carried set): flash_attn-2.0-py3-none-any.whl" in problems, problems
    assert "missing: verl==0.9.1" in problems and "triton" not in problems, problems


@pytest.mark.slow
def test_cpu_smoke_covers_every_step_and_column_and_fails_on_a_missing_one(tmp_path):
    res = _run("--cpu-smoke", "--out", str(tmp_path), timeout=600)
    report = (tmp_path / "gpu_acceptance.md").read_text()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_acceptance as ga

    for name in ga.STEPS:
        assert f"({name}: exit 0" in report, (name, res.stdout[-3000:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["missing"] == [], summary["missing"]
    assert set(summary["steps"]) == set(ga.STEPS) and all(summary["steps"].values())
    lp = summary["results"]["logprob_kernels"]["rows"]
    assert {r["method"] for r in lp} == set(ga.LOGPROB_METHODS)
    assert set(summary["results"]["output_layer"]["methods"]) == set(ga.OUTPUT_METHODS)
    assert set(summary["results"]["megatron_step"]["variants"]) == set(ga.MEGATRON_VARIANTS)
    assert set(summary["results"]["loss_hook_1m_tokens"]["rows"]) == set(ga.HOOK_ROWS)
    assert summary["results"]["correction_vs_verl"]["rows"]
    table = (tmp_path / "summary.md").read_text()
    for name in ga.STEPS:
        assert f"| {name} | 0 |" in table, name
    assert res.returncode == 0, res.stdout[-3000:]
    assert "all checks passed" in report
    # a column taken out of one step's file: the summary names it and fails
    path = tmp_path / "logprob_kernel.json"
    data = json.loads(path.read_text())
    del data["rows"][0]["mem"]
    data["rows"] = [r for r in data["rows"] if r["method"] != "cce"]
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_acceptance.py"), "--summary", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "column 'mem' missing" in proc.stdout and "method 'cce' missing" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow
def test_megatron_step_fails_when_the_triton_row_would_time_the_torch_code():
    """Without the interpreter, CPU tensors cannot run the Triton kernels: the fallback to torch is an error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_megatron_step.py"), "--device", "cpu",
                           "--tiny", "--only", "plain,hook alg0 triton"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "FAILED variants (a kernel fallback is a failure): hook alg0 triton" in proc.stdout
    assert "KernelFallbackWarning" in proc.stdout
