"""Fused output layer (``slime_tis.kernels.output_layer``) on one process against a float64 oracle.

Oracle: float64 ``log_softmax(h W^T / tau)`` with autograd (``reference_log_probs_and_entropy``). Compared:
log-probs, entropies, the gradients to the hidden states and to the weight of
``sum(mask * (g_lp lp + g_H H))``, with temperatures != 1, masked rows and chunks that split the vocabulary
raggedly. The torch backend runs here; the Triton kernels run in a subprocess with ``TRITON_INTERPRET=1``
(set before triton is imported). TP=2 and the megatron glue: tests/dist/test_kernels_output_layer_tp.py.

Tolerances: float32 inputs are exact in float64, so the errors are float32 rounding of O(H) products and
O(V) exponentials: 1e-5 absolute on values (|lp| < 10) and 1e-5 relative (max-abs) on gradients. bf16
inputs are exact too (values: same 1e-5), but the gradients come back in bf16 after a bf16 ``dL/dz`` chunk:
two bf16 roundings (2^-8 relative each) -> 2e-2 relative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _interpret import reset_dispatch
from _output_layer_cases import CASES, accumulation, accuracy, non_finite, reference_log_probs_and_entropy, run

from slime_tis.kernels import dispatch
from slime_tis.kernels.output_layer import fused_log_probs_and_entropy

HERE = Path(__file__).resolve().parent


def _tolerances(name: str) -> tuple[float, float]:
    """(absolute on values, relative on gradients)."""
    return (1e-5, 2e-2) if name.startswith("bf16") else (1e-5, 1e-5)


def _check_case(name: str, res: dict) -> None:
    val_tol, grad_tol = _tolerances(name)
    assert res["lp"] <= val_tol and res["ent"] <= val_tol, (name, res)
    assert res["grad_hidden"] <= grad_tol and res["grad_weight"] <= grad_tol, (name, res)
    assert res["masked_zero"], (name, res)
    dtype = "torch.bfloat16" if name.startswith("bf16") else "torch.float32"
    assert res["dtypes"] == ["torch.float32", dtype, dtype], (name, res)


def _check_accuracy(res: dict) -> None:
    assert 45.0 <= res["zmax"] <= 55.0, res
    # the claim: >= 10x smaller log-prob error than rounding the logits to bf16 (measured ~1e4x)
    assert res["err_fused"] * 10 <= res["err_bf16_logits"], res
    assert res["err_bf16_logits"] > 1e-2, res  # the bf16-logits path really is off at this scale


@pytest.mark.parametrize("name", sorted(CASES))
def test_torch_backend_matches_float64(name):
    _check_case(name, run(name, "torch"))


def test_accuracy_with_large_logits_torch_backend():
    _check_accuracy(accuracy("torch"))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, str(HERE / "_output_layer_cases.py"), "triton"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_interpreter_matches_float64(interpreter_results, name):
    _check_case(name, interpreter_results[name])


def test_accuracy_with_large_logits_triton_interpreter(interpreter_results):
    _check_accuracy(interpreter_results["accuracy"])


def _check_accumulation(res: dict) -> None:
    """float32 sums of 320 exact bf16 products: worst case 320 * 2^-24 = 1.9e-5 relative, typically ~1e-7; the
    earlier path rounds each chunk's product to bf16 (2^-9 relative each), the last chunk's bf16 store rounds
    once (2^-8 relative to nearest; a full ulp, 2^-7, under the interpreter, which truncates)."""
    assert res["err_f32"] <= 1.9e-5, res
    assert res["err_old"] >= 100 * res["err_f32"] and res["err_old"] > 1e-4, res  # the rounding it no longer has
    assert res["err_final_bf16"] <= 2**-7, res
    assert res["inactive_zero"], res


def _check_non_finite(res: dict) -> None:
    assert all(res.values()), res


def test_hidden_gradient_accumulates_in_float32_torch_backend():
    _check_accumulation(accumulation("torch"))


def test_hidden_gradient_accumulates_in_float32_triton_interpreter(interpreter_results):
    _check_accumulation(interpreter_results["accumulation"])


def test_non_finite_rows_torch_backend():
    _check_non_finite(non_finite("torch"))


@pytest.mark.parametrize("semantics", ["non_finite", "non_finite_gpu_max"])
def test_non_finite_rows_triton_interpreter(interpreter_results, semantics):
    """Also with the GPU's NaN-dropping elementwise max/min (``_interpret.gpu_max_semantics``)."""
    _check_non_finite(interpreter_results[semantics])


def test_tied_embedding_gradient_accumulates():
    """The output weight is the embedding: its gradient is the embedding's plus the output layer's."""
    g = torch.Generator().manual_seed(5)
    vocab, hid, n_tok = 40, 16, 23
    emb = torch.randn(vocab, hid, generator=g) * 0.5
    mix = torch.randn(hid, hid, generator=g) / hid ** 0.5
    tokens = torch.randint(0, vocab, (n_tok,), generator=g)
    targets = torch.randint(0, vocab, (n_tok,), generator=g)

    def loss(e, fused):
        hidden = torch.tanh(e[tokens] @ mix.to(e.dtype))
        if fused:
            lp, ent = fused_log_probs_and_entropy(hidden, e, targets, temperature=0.8, kernels="torch", chunk_size=16)
        else:
            lp, ent = reference_log_probs_and_entropy(hidden, e, targets, temperature=0.8)
        return (lp - 0.1 * ent).sum()

    e32 = emb.clone().requires_grad_(True)
    loss(e32, True).backward()
    e64 = emb.double().requires_grad_(True)
    loss(e64, False).backward()
    rel = float((e32.grad.double() - e64.grad).abs().max() / e64.grad.abs().max())
    assert rel <= 1e-5
    # both uses contribute: the output-layer part alone is far from the total
    e_out = emb.double().requires_grad_(True)
    hidden = torch.tanh(emb.double()[tokens] @ mix.double())
    lp, ent = reference_log_probs_and_entropy(hidden, e_out, targets, temperature=0.8)
    (lp - 0.1 * ent).sum().backward()
    assert float((e_out.grad - e64.grad).abs().max() / e64.grad.abs().max()) > 1e-2


def test_entropy_unused_and_leading_dims():
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(2, 5, 8, generator=g).requires_grad_(True)
    weight = torch.randn(30, 8, generator=g).requires_grad_(True)
    targets = torch.randint(0, 30, (2, 5), generator=g)
    lp, ent = fused_log_probs_and_entropy(hidden, weight, targets, temperature=1.3, kernels="torch", chunk_size=7)
    assert lp.shape == ent.shape == (2, 5)
    lp.sum().backward()  # no gradient flows into the entropy output
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    lp_r, _ = reference_log_probs_and_entropy(h64, w64, targets, temperature=1.3)
    lp_r.sum().backward()
    assert float((hidden.grad.double() - h64.grad).abs().max()) <= 1e-5 * float(h64.grad.abs().max())
    assert float((weight.grad.double() - w64.grad).abs().max()) <= 1e-5 * float(w64.grad.abs().max())


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": 0.0}, "temperature"),
    ({"chunk_size": 0}, "chunk_size"),
    ({"kernels": "cuda"}, "kernels must be one of 'torch', 'triton'"),
    ({"loss_mask": torch.ones(3)}, "loss_mask"),
    ({"tp_group": "megatron"}, "tp_group"),
])
def test_bad_arguments_raise_naming_them(kwargs, match):
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match=match):
        fused_log_probs_and_entropy(hidden, weight, targets, **kwargs)


def test_bad_tensors_raise_naming_them():
    hidden, weight, targets = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="weight"):
        fused_log_probs_and_entropy(hidden, torch.randn(10, 7), targets)
    with pytest.raises(ValueError, match="weight"):
        fused_log_probs_and_entropy(hidden, weight.double(), targets)
    with pytest.raises(ValueError, match="hidden"):
        fused_log_probs_and_entropy(hidden.double(), weight.double(), targets)
    with pytest.raises(ValueError, match="targets"):
        fused_log_probs_and_entropy(hidden, weight, targets.float())
    with pytest.raises(ValueError, match="targets shape"):
        fused_log_probs_and_entropy(hidden, weight, targets[:3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check")
def test_triton_on_cpu_without_interpreter_warns_once_and_runs_torch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reset_dispatch()
    h, w, y = torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long)
    with pytest.warns(dispatch.KernelFallbackWarning, match="output_layer kernel cannot run .*TRITON_INTERPRET"):
        lp, ent = fused_log_probs_and_entropy(h, w, y, kernels="triton")
    ref = fused_log_probs_and_entropy(h, w, y, kernels="torch")
    assert torch.equal(lp, ref[0]) and torch.equal(ent, ref[1])
    reset_dispatch()


def test_a_failing_kernel_falls_back_to_torch_triton_interpreter(interpreter_results):
    """Forward kernel fails: the torch code, same numbers; the backward's dL/dh kernel fails after the first
    chunk's dL/dz ran on Triton: the torch code from there, within the usual tolerances. One warning each."""
    res = interpreter_results["fallback"]
    for name, case in res.items():
        assert len(case["warnings"]) == 1 and "shared memory" in case["warnings"][0], (name, case)
        _check_case("bf16_tau09_masked", case["result"])
    assert res["_stats_kernel"]["same_as_torch"], res


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_benchmark_exits_clearly_without_cuda():
    proc = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "bench_output_layer.py"), "--tokens", "8"],
                          capture_output=True, text=True, timeout=120, cwd=HERE.parent)
    assert proc.returncode == 2 and "CUDA is not available" in proc.stderr, proc.stderr[-2000:]


def test_kernels_compile_for_h100_without_a_gpu():
    """The interpreter skips the compiler: build both kernels (bf16, launch configuration) to an sm_90 cubin.

    Also checks the build is a sane one: loads pipelined into shared memory (async copies), within the H100's
    228 KiB of shared memory, and no register spills (ptxas -v). (float32 builds too, but its IEEE dot takes
    ptxas ~40 s on the shared CI box.)
    """
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from _output_layer_aot import compile_for_cuda
    kernels = compile_for_cuda(torch.bfloat16, hidden_size=4096, vocab_shard=152064, chunk=8192)
    assert set(kernels) == {"stats", "dlogits", "dhidden"}
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    for name, kernel in kernels.items():
        assert 0 < kernel.metadata.shared <= 228 * 1024, (name, kernel.metadata.shared)
        assert kernel.asm["ttgir"].count("async_copy_global_to_local") > 0, name
        if ptxas.exists():
            ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"slime_tis_{os.getpid()}_{name}.ptx"
            ptx.write_text(kernel.asm["ptx"])
            try:
                info = subprocess.run([str(ptxas), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                                      capture_output=True, text=True, timeout=120).stderr
            finally:
                ptx.unlink()
            assert " 0 bytes spill stores" in info, (name, info)


def test_no_tensor_the_size_of_the_logits_is_ever_allocated():
    """Every op output during fwd+bwd (torch backend) stays at chunk size; the unfused path needs [T, V]."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class MaxNumel(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel())
            return out

    n_tok, hid, vocab, chunk = 64, 16, 512, 64
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(n_tok, hid, generator=g).requires_grad_(True)
    weight = torch.randn(vocab, hid, generator=g).requires_grad_(True)
    targets = torch.randint(0, vocab, (n_tok,), generator=g)
    for fused in (True, False):
        with MaxNumel() as mode:
            if fused:
                lp, ent = fused_log_probs_and_entropy(hidden, weight, targets, kernels="torch", chunk_size=chunk)
            else:
                lp, ent = reference_log_probs_and_entropy(hidden, weight, targets, logits_dtype=torch.float32)
            (lp.sum() + ent.sum()).backward()
        if fused:
            assert mode.largest <= max(n_tok * chunk, vocab * hid, n_tok * hid), mode.largest
        else:  # the control: the plain path materialises [T, V]
            assert mode.largest >= n_tok * vocab


def test_gradient_of_entropy_only():
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(11, 8, generator=g).requires_grad_(True)
    weight = torch.randn(30, 8, generator=g).requires_grad_(True)
    targets = torch.randint(0, 30, (11,), generator=g)
    _, ent = fused_log_probs_and_entropy(hidden, weight, targets, temperature=0.6, kernels="torch", chunk_size=7)
    ent.sum().backward()
    h64, w64 = hidden.detach().double().requires_grad_(True), weight.detach().double().requires_grad_(True)
    _, ent_r = reference_log_probs_and_entropy(h64, w64, targets, temperature=0.6)
    ent_r.sum().backward()
    assert float((hidden.grad.double() - h64.grad).abs().max()) <= 1e-5 * float(h64.grad.abs().max())
    assert float((weight.grad.double() - w64.grad).abs().max()) <= 1e-5 * float(w64.grad.abs().max())


def test_empty_micro_batch():
    hidden = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    lp, ent = fused_log_probs_and_entropy(hidden, weight, torch.zeros(0, dtype=torch.long), kernels="torch",
                                          chunk_size=16)
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == ent.shape == (0,) and hidden.grad.shape == (0, 16)
    assert float(weight.grad.abs().sum()) == 0.0


def test_works_without_triton():
    """triton unimportable: the torch code never imports the kernels; kernels='triton' warns once and runs it."""
    code = (
        "import sys, warnings; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch\n"
        "from slime_tis.kernels.dispatch import KernelFallbackWarning\n"
        "from slime_tis.kernels.output_layer import fused_log_probs_and_entropy as f\n"
        "h, w, y = torch.randn(3, 8), torch.randn(10, 8), torch.tensor([0, 1, 9])\n"
        "lp, ent = f(h, w, y)\n"
        "assert torch.isfinite(lp).all() and 'slime_tis.kernels._output_layer_triton' not in sys.modules\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    lp_t, _ = f(h, w, y, kernels='triton')\n"
        "msgs = [str(m.message) for m in seen if m.category is KernelFallbackWarning]\n"
        "assert len(msgs) == 1 and 'triton is not importable' in msgs[0], msgs\n"
        "assert torch.equal(lp_t, lp)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE.parent, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
