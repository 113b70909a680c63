"""The Triton kernels of the sampling-support replay (``kernels.logprobs``) against the float64 masked
log-softmax and the torch replay: values and gradients, one-token and whole-vocabulary rows, masked rows holding
NaN, bf16 logits, a target outside its support (NaN), a NaN logit inside a support (NaN).

On a CPU the kernel cases run in a child pytest with ``TRITON_INTERPRET=1`` (``tests/_interpret.py``; a fallback
to the torch code is an error there). Tolerances as tests/test_support_logprobs.py: 2e-5 absolute in float32,
bf16 gradients within 2**-7 of the largest.
"""

from __future__ import annotations

import pytest
import torch
from _interpret import INTERPRETED, assert_module_passes_under_interpreter
from test_support_logprobs import TAU, T, V, make_case, oracle

from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy

ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if ON_CUDA else "cpu"
N_KERNEL_CASES = 4
kernel_case = pytest.mark.skipif(not (INTERPRETED or ON_CUDA),
                                 reason="CPU: run by test_kernel_cases_under_triton_interpreter in a child process")


def _run(logits, targets, ids, offsets, w_lp, w_h, kernels, row_mask=None):
    z = logits.to(DEVICE).clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs_and_entropy(
        z, targets.to(DEVICE), temperature=TAU, tp_group=None, kernels=kernels, row_mask=row_mask,
        support=(ids.to(DEVICE), offsets.to(DEVICE)))
    (grad,) = torch.autograd.grad((lp * w_lp.to(DEVICE)).sum() + (ent * w_h.to(DEVICE)).sum(), z)
    return lp.detach().cpu(), ent.detach().cpu(), grad.cpu()


@kernel_case
@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_float64_and_the_torch_replay(seed):
    logits, targets, ids, offsets, rows = make_case(seed)
    g = torch.Generator().manual_seed(30 + seed)
    w_lp, w_h = torch.randn(T, generator=g), torch.randn(T, generator=g)
    keep = torch.ones(T, dtype=torch.bool)
    keep[[4, 7]] = False
    nan_logits = logits.clone()
    nan_logits[~keep] = float("nan")
    got = _run(nan_logits, targets, ids, offsets, w_lp, w_h, "triton", row_mask=keep.to(DEVICE))
    torch_path = _run(nan_logits, targets, ids, offsets, w_lp, w_h, "torch", row_mask=keep.to(DEVICE))
    ref = oracle(logits, targets, rows, w_lp, w_h, keep=keep)
    for a, b, t in zip(got, ref, torch_path):
        assert torch.isfinite(a).all()
        assert (a.double() - b).abs().max() < 2e-5 and (a - t).abs().max() < 2e-5


@kernel_case
def test_kernel_bfloat16_and_without_entropy():
    logits, targets, ids, offsets, rows = make_case(2)
    b = logits.to(torch.bfloat16)
    w_lp, w_h = torch.randn(T), torch.randn(T)
    lp, ent, grad = _run(b, targets, ids, offsets, w_lp, w_h, "triton")
    ref = oracle(b.float(), targets, rows, w_lp, w_h)
    assert grad.dtype == torch.bfloat16
    assert (lp.double() - ref[0]).abs().max() < 2e-5 and (ent.double() - ref[1]).abs().max() < 2e-5
    assert (grad.double() - ref[2]).abs().max() < 2**-7 * float(ref[2].abs().max()) + 1e-5
    lp2, ent2 = vocab_parallel_log_probs_and_entropy(b.to(DEVICE), targets.to(DEVICE), temperature=TAU,
                                                     tp_group=None, kernels="triton", with_entropy=False,
                                                     support=(ids.to(DEVICE), offsets.to(DEVICE)))
    assert ent2 is None and (lp2.cpu() - lp).abs().max() == 0


@kernel_case
def test_kernel_bad_rows_are_nan():
    logits = torch.randn(3, V)
    logits[1, 6] = float("nan")
    targets = torch.tensor([5, 6, 7])
    ids = torch.tensor([1, 2, 6, 9], dtype=torch.int32)        # row 0 lacks its target; row 1 holds a NaN logit
    offsets = torch.tensor([0, 2, 4, 4])                       # row 2: empty
    lp, ent = vocab_parallel_log_probs_and_entropy(logits.to(DEVICE), targets.to(DEVICE), tp_group=None,
                                                   kernels="triton",
                                                   support=(ids.to(DEVICE), offsets.to(DEVICE)))
    assert lp.isnan().all() and ent[1].isnan()


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run itself")
def test_kernel_cases_under_triton_interpreter():
    """This module's kernel cases on the CPU in a child process with TRITON_INTERPRET=1; all must pass."""
    pytest.importorskip("triton")
    assert_module_passes_under_interpreter(__file__, N_KERNEL_CASES)


@pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) kernels")
def test_kernels_compile_for_h100():
    """Both replay kernels lower to sm_90 machine code (bf16 logits, every constexpr branch) without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from slime_tis.kernels import logprobs as k

    if not isinstance(k._support_fwd_kernel, triton.runtime.JITFunction):
        pytest.skip("the kernels module was imported under TRITON_INTERPRET=1 in this process")
    fwd_sig = {"z_ptr": "*bf16", "z_stride": "i64", "tgt_ptr": "*i64", "ids_ptr": "*i32", "off_ptr": "*i64",
               "mask_ptr": "*u8", **{f"o{i}_ptr": "*fp32" for i in range(5)}, "vocab_start": "i64",
               "inv_tau": "fp32", "n_cols": "i64", "HAS_MASK": "constexpr", "WITH_ENTROPY": "constexpr",
               "FINAL": "constexpr", "BLOCK_S": "constexpr"}
    bwd_sig = {"z_ptr": "*bf16", "z_stride": "i64", "g_ptr": "*bf16", "g_stride": "i64", "tgt_ptr": "*i64",
               "ids_ptr": "*i32", "off_ptr": "*i64", "mask_ptr": "*u8", "logz_ptr": "*fp32", "h_ptr": "*fp32",
               "glp_ptr": "*fp32", "gh_ptr": "*fp32", "vocab_start": "i64", "inv_tau": "fp32", "n_cols": "i64",
               "HAS_MASK": "constexpr", "HAS_GLP": "constexpr", "HAS_GH": "constexpr", "BLOCK_S": "constexpr"}
    cases = [(k._support_fwd_kernel, fwd_sig, dict(HAS_MASK=m, WITH_ENTROPY=e, FINAL=f))
             for m, e, f in [(True, True, True), (False, False, False)]]
    cases += [(k._support_bwd_kernel, bwd_sig, dict(HAS_MASK=True, HAS_GLP=True, HAS_GH=True)),
              (k._support_bwd_kernel, bwd_sig, dict(HAS_MASK=False, HAS_GLP=False, HAS_GH=True))]
    for fn, sig, flags in cases:
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(BLOCK_S=64, **flags))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
        assert compiled.asm["cubin"], f"{fn.__name__} {flags}: no machine code"
