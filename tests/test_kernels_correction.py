"""The Triton token pass + per-sequence sums (``slime_tis.kernels.correction``) against the torch reference.

triton reads ``TRITON_INTERPRET`` when a kernel is defined, and other tests of a session may import triton
first: on the CPU the kernel cases therefore run in a child pytest process with ``TRITON_INTERPRET=1``
(``test_kernel_cases_under_triton_interpreter``) and are skipped in this one. ``test_kernel_compiles_for_h100``
lowers the kernel to sm_90 machine code without a GPU.

Tolerances: ``l`` is the same float32 arithmetic on both sides (exact, NaN where NaN); the per-sequence sums are float64
sums of the same float32 values in another order: 1e-12 relative."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _interpret import INTERPRETED, assert_module_passes_under_interpreter, gpu_max_semantics, reset_dispatch

from slime_tis.core.packing import packed_layout
from slime_tis.core.ratios import packed_ratios
from slime_tis.core.reducer import LocalReducer

ROOT = Path(__file__).resolve().parents[1]
N_KERNEL_CASES = 20
kernel_case = pytest.mark.skipif(not INTERPRETED, reason="run by test_kernel_cases_under_triton_interpreter")


def _batch(seed: int, lengths: list[int]):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    t = int(cu[-1])
    lr = -4 * torch.rand(t, generator=g)
    lt = lr + 0.3 * torch.randn(t, generator=g)
    valid = torch.rand(t, generator=g) > 0.2
    adv = torch.randn(t, generator=g)
    if t > 8:  # traps: NaN / inf at valid and at masked tokens, in the log-probs and in an extra tensor
        lt[1], lr[3], adv[5], lt[7] = math.nan, -math.inf, math.inf, math.nan
        valid[7] = False
    return lt, lr, valid, cu, adv


@kernel_case
@pytest.mark.parametrize("lengths", [[5, 0, 300, 1, 17], [1], [0, 0], [600, 3], [64] * 9])
@pytest.mark.parametrize("n_extra", [0, 1, 2])
def test_kernel_matches_torch_reference(lengths, n_extra):
    kernels = pytest.importorskip("slime_tis.kernels.correction")
    lt, lr, valid, cu, adv = _batch(sum(lengths) + n_extra, lengths)
    extra = (adv, lt.clone())[:n_extra]
    l_k, sums_k = kernels.sequence_sums(lt, lr, valid, cu.long(), extra, block=64)
    ref = packed_ratios(lt, lr, valid, packed_layout(cu, lt.numel(), lt.device), LocalReducer(), extra_finite=extra)
    ref_l = lt - lr
    for e in extra:
        ref_l = torch.where(torch.isfinite(e), ref_l, math.nan)
    ref_l = torch.where(valid, ref_l, 0.0)
    assert torch.allclose(l_k, ref_l, equal_nan=True, rtol=0, atol=0)
    full = ref.seq_sums[:, :3]
    finite_rows = torch.isfinite(full).all(1)
    torch.testing.assert_close(sums_k[finite_rows], full[finite_rows], rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isfinite(sums_k), torch.isfinite(full))


@kernel_case
@pytest.mark.parametrize("semantics", ["interpreter", "gpu"])
def test_non_finite_sequences_stay_non_finite(semantics):
    """NaN / inf at valid tokens (log-probs and extra tensors) make exactly those sequences' ``sum l``
    non-finite, also with the GPU's NaN-dropping max/min (``gpu_max_semantics``); masked ones change nothing."""
    kernels = pytest.importorskip("slime_tis.kernels.correction")
    lengths = [12, 12, 12, 12, 12, 12]
    lt, lr, valid, cu, adv = _batch(5, lengths)
    lt, lr, valid, adv = lt.nan_to_num(0.0, 0.0, 0.0), lr.nan_to_num(0.0, 0.0, 0.0), valid.clone(), adv.nan_to_num(0.0)
    valid[:] = True
    lt[1], lr[14], adv[27], adv[40] = math.nan, -math.inf, math.inf, math.nan  # sequences 0, 1, 2, 3
    valid[60] = False
    lt[60], adv[61] = math.nan, -math.inf   # sequence 5: a masked NaN (ignored) and a valid -inf advantage
    with gpu_max_semantics(semantics == "gpu"):
        l_k, sums_k = kernels.sequence_sums(lt, lr, valid, cu.long(), (adv,), block=8)
    assert torch.equal(torch.isfinite(sums_k[:, 0]), torch.tensor([False, False, False, False, True, False]))
    assert torch.equal(torch.isfinite(sums_k[:, 1]), torch.tensor([True, False, True, True, True, True]))
    assert sums_k[:, 2].tolist() == [12, 12, 12, 12, 12, 11]
    assert l_k[60] == 0 and torch.isnan(l_k[61])


@kernel_case
@pytest.mark.parametrize("cfg_kwargs", [dict(use_tis=True), dict(use_tis=True, level="geometric", mode="mask",
                                                                   veto_threshold=1e-2, seq_max_k3_threshold=1.0)])
def test_core_through_the_kernel_equals_the_torch_path(monkeypatch, cfg_kwargs):
    """The whole policy loss with ``TISConfig(kernels="triton")`` (interpreter) equals the torch path."""
    kernels = pytest.importorskip("slime_tis.kernels.correction")
    from slime_tis import TISConfig, policy_loss

    calls = []
    real = kernels.sequence_sums
    monkeypatch.setattr(kernels, "sequence_sums", lambda *a, **k: calls.append(1) or real(*a, **k))

    lt, lr, valid, cu, adv = _batch(3, [40, 0, 7, 130, 1])
    outs = []
    for mode in ("torch", "triton"):  # torch path, then the kernel (interpreter)
        cfg = TISConfig(**cfg_kwargs, kernels=mode)
        theta = (lt + 0.01).nan_to_num(0.0).requires_grad_(True)
        out = policy_loss(cfg, theta, lt, lr, adv, valid, cu)
        out.loss.backward()
        outs.append((out, theta.grad))
    assert calls, "the forced run did not take the kernel"
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-7)
    assert torch.equal(a.keep_mask, b.keep_mask)
    fa, fb = a.stats.finalize(), b.stats.finalize()
    assert fa.keys() == fb.keys()
    for k in fa:
        torch.testing.assert_close(fa[k], fb[k], rtol=1e-9, atol=1e-12)


@kernel_case
def test_a_failing_kernel_falls_back_to_torch_with_one_warning(monkeypatch):
    """The kernel fails to launch: the torch columns instead, one warning naming the error, no retry."""
    import warnings

    kernels = pytest.importorskip("slime_tis.kernels.correction")
    from slime_tis.kernels import dispatch
    from slime_tis.kernels.token_pass import token_pass_for

    calls = []

    class Failing:  # stands in for the @triton.jit kernel
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                calls.append(1)
                raise RuntimeError("no kernel image for sm_90")
            return launch

    monkeypatch.setattr(kernels, "_sequence_sums_kernel", Failing())
    lt, lr, valid, cu, adv = _batch(4, [30, 5, 60])
    layout = packed_layout(cu, lt.numel(), lt.device)
    ref = packed_ratios(lt, lr, valid, layout, LocalReducer(), extra_finite=(adv,))
    reset_dispatch()
    try:
        for expected in (1, 0):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                got = packed_ratios(lt, lr, valid, layout, LocalReducer(), extra_finite=(adv,),
                                    token_pass=token_pass_for("triton"))
            msgs = [str(w.message) for w in seen if issubclass(w.category, dispatch.KernelFallbackWarning)]
            assert len(msgs) == expected and all("no kernel image for sm_90" in m for m in msgs), msgs
            assert torch.equal(got.seq_sums.nan_to_num(7.0), ref.seq_sums.nan_to_num(7.0))
        assert len(calls) == 1
    finally:
        reset_dispatch()


@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run itself")
def test_kernel_cases_under_triton_interpreter():
    """This module's kernel cases on the CPU in a child process with TRITON_INTERPRET=1; all must pass."""
    pytest.importorskip("triton")
    assert_module_passes_under_interpreter(__file__, N_KERNEL_CASES)


@pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) kernels")
@pytest.mark.parametrize("n_extra", [0, 2])
def test_kernel_compiles_for_h100(n_extra):
    """The kernel lowers to sm_90 machine code (every constexpr branch used) without a GPU."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = pytest.importorskip("slime_tis.kernels.correction")
    if not isinstance(k._sequence_sums_kernel, triton.runtime.JITFunction):
        pytest.skip("the kernel module was imported under TRITON_INTERPRET=1 in this process")
    sig = {"lt_ptr": "*bf16", "lr_ptr": "*fp32", "valid_ptr": "*u8", "e0_ptr": "*fp32", "e1_ptr": "*fp32",
           "cu_ptr": "*i64", "l_ptr": "*fp32", "sums_ptr": "*fp64", "N_EXTRA": "constexpr", "BLOCK": "constexpr"}
    src = ASTSource(fn=k._sequence_sums_kernel, signature=sig, constexprs=dict(N_EXTRA=n_extra, BLOCK=256))
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]
