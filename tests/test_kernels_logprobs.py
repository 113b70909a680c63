"""The fused Triton log-prob / entropy kernels (``slime_tis.kernels.logprobs``) against float64 autograd.

Where they run: on CUDA when this machine has a GPU; on CPU under triton's interpreter. triton reads
``TRITON_INTERPRET`` when a kernel is *defined* (module import), and other tests of the same pytest session
may import triton first, so on CPU the kernel cases run in a child pytest process started with
``TRITON_INTERPRET=1`` (``test_kernel_cases_under_triton_interpreter``); in this process they are skipped.
Without triton installed everything kernel-related is skipped (the torch path needs no triton).

Also here: the kernels compile for sm_90 ahead of time (triton's bundled ptxas, no GPU needed), and the
torch reference's -inf / row-mask behaviour that the kernels must share.

Tolerances: values are float32 math on the same input values as the float64 oracle, over <= 64 columns:
|error| <~ 64 * 2^-24 * max|x| ~ 1e-5 for |x| <= 20, so atol 2e-5. Gradients are stored in the logits'
dtype: float32 atol 1e-5 (the ~1e-6 error of logZ enters multiplied by |g_H| <= 10); bfloat16 / float16
add one rounding to the output dtype: one ulp, rtol 2^-7 / 2^-10 (triton's interpreter truncates to
bfloat16 where the GPU rounds to nearest, so a full ulp, not half).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from _interpret import INTERPRETED, assert_module_passes_under_interpreter, gpu_max_semantics, reset_dispatch

from slime_tis.kernels import dispatch
from slime_tis.megatron import vocab_parallel_log_probs_and_entropy as lp_and_entropy

ROOT = Path(__file__).resolve().parents[1]
ON_CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = "cuda" if ON_CUDA else "cpu"
N_KERNEL_CASES = 26  # kernel cases this module defines (the child run must pass all of them)

kernel_case = pytest.mark.skipif(not (INTERPRETED or ON_CUDA),
                                 reason="CPU: run by test_kernel_cases_under_triton_interpreter in a child process")


def _kernels():
    pytest.importorskip("triton")
    from slime_tis.kernels import logprobs
    return logprobs


def _oracle(logits: torch.Tensor, targets: torch.Tensor, tau: float):
    """float64 ``log_softmax(z / tau)``: (leaf z, lp [T], H [T]); -inf logits have p = 0 and add 0 to H."""
    z = logits.detach().cpu().double().requires_grad_(True)
    lsm = torch.log_softmax(z / tau, dim=-1)
    lp = lsm.gather(-1, targets.cpu()[..., None]).squeeze(-1)
    ent = -(lsm.exp() * torch.where(torch.isinf(lsm), 0.0, lsm)).sum(-1)
    return z, lp, ent


def _grad_tol(dtype: torch.dtype) -> dict:
    return {torch.float32: dict(rtol=0, atol=1e-5), torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
            torch.float16: dict(rtol=2**-10, atol=1e-5)}[dtype]


def _data(n: int, v: int, seed: int, dtype=torch.float32, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(n, v, generator=g) * scale).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    w_lp, w_h = torch.randn(n, generator=g), 3 * torch.randn(n, generator=g)
    return logits, targets, w_lp, w_h


def _run_kernel(logits, targets, w_lp, w_h, *, tau=1.0, block_v=None, row_mask=None, with_entropy=True):
    """Kernel on DEVICE: (lp, H, d(w_lp . lp + w_h . H)/dz), all back on CPU."""
    k = _kernels()
    z = logits.to(DEVICE, copy=True).requires_grad_(True)
    mask = None if row_mask is None else row_mask.to(DEVICE)
    lp, ent = k.fused_log_probs_and_entropy(z, targets.to(DEVICE), temperature=tau, block_v=block_v,
                                            row_mask=mask, with_entropy=with_entropy)
    loss = (ent * w_h.to(DEVICE)).sum() if with_entropy else 0.0
    if w_lp is not None:  # None: lp unused, so its upstream gradient is None (the kernel's HAS_GLP=False)
        loss = loss + (lp * w_lp.to(DEVICE)).sum()
    (grad,) = torch.autograd.grad(loss, z)
    return lp.detach().cpu(), ent.detach().cpu(), grad.cpu()


def _oracle_grad(z, lp_ref, ent_ref, w_lp, w_h, with_entropy=True):
    loss = (lp_ref * w_lp.double()).sum() + ((ent_ref * w_h.double()).sum() if with_entropy else 0.0)
    (g,) = torch.autograd.grad(loss, z)
    return g


# ------------------------------------------------------------------------------------------ kernel cases
@kernel_case
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("block_v", [16, None])  # 16: 3 column blocks, the last one partial; None: one block
def test_values_and_both_gradients_match_float64(dtype, tau, block_v):
    logits, targets, w_lp, w_h = _data(5, 37, seed=1, dtype=dtype)
    lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=tau, block_v=block_v)
    z, lp_ref, ent_ref = _oracle(logits, targets, tau)
    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad.double(), _oracle_grad(z, lp_ref, ent_ref, w_lp, w_h), **_grad_tol(dtype))


@kernel_case
def test_each_gradient_alone():
    """Only lp used (entropy off, HAS_GH=False) / only H used (lp unused: grad_lp is None, HAS_GLP=False)."""
    logits, targets, w_lp, w_h = _data(4, 29, seed=2)
    lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=1.3, block_v=8, with_entropy=False)
    z, lp_ref, ent_ref = _oracle(logits, targets, 1.3)
    assert (ent == 0).all()
    torch.testing.assert_close(grad.double(), _oracle_grad(z, lp_ref, ent_ref, w_lp, w_h, False), rtol=0, atol=1e-5)
    _, _, grad_h = _run_kernel(logits, targets, None, w_h, tau=1.3, block_v=8)
    z, lp_ref, ent_ref = _oracle(logits, targets, 1.3)
    torch.testing.assert_close(grad_h.double(), _oracle_grad(z, lp_ref, ent_ref, torch.zeros(4), w_h),
                               rtol=0, atol=1e-5)


@kernel_case
def test_minus_infinity_logits():
    """-inf columns (vocabulary masks): a whole first block, scattered entries, and a -inf target."""
    logits, targets, w_lp, w_h = _data(4, 40, seed=3)
    logits[0, :16] = float("-inf")            # the whole first block (block_v=16): running max starts at f32 min
    logits[1, ::3] = float("-inf")
    logits[2, 20:] = float("-inf")
    targets[0], targets[1] = 16, 1
    targets[3] = 5
    logits[3, 5] = float("-inf")              # the target itself: p = 0, lp = float32 min (finite), as torch
    lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=0.8, block_v=16)
    z, lp_ref, ent_ref = _oracle(logits[:3], targets[:3], 0.8)
    torch.testing.assert_close(lp[:3].double(), lp_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(ent[:3].double(), ent_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad[:3].double(), _oracle_grad(z, lp_ref, ent_ref, w_lp[:3], w_h[:3]),
                               rtol=0, atol=1e-5)
    assert lp[3] == torch.finfo(torch.float32).min and torch.isfinite(ent).all()
    assert torch.isfinite(grad).all()
    finite_cols = torch.isfinite(logits)
    finite_cols[3, 5] = True                  # the -inf target still gets its one-hot term g_lp / tau
    assert (grad[~finite_cols] == 0).all()
    torch.testing.assert_close(grad[3, 5], w_lp[3] / 0.8)


@kernel_case
@pytest.mark.parametrize("v, block_v", [(32, 16), (33, 16), (7, 16)])
def test_target_at_the_shard_edges(v, block_v):
    """Targets 0 and V-1: the first and last column of the shard (and of its last, maybe partial, block)."""
    logits, _, w_lp, w_h = _data(4, v, seed=4)
    targets = torch.tensor([0, v - 1, v - 1, 0])
    lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=0.9, block_v=block_v)
    z, lp_ref, ent_ref = _oracle(logits, targets, 0.9)
    torch.testing.assert_close(lp.double(), lp_ref.detach(), rtol=0, atol=2e-5)
    torch.testing.assert_close(grad.double(), _oracle_grad(z, lp_ref, ent_ref, w_lp, w_h), rtol=0, atol=1e-5)


@kernel_case
def test_masked_rows_are_not_read_and_get_zero_gradient():
    """NaN in the masked rows: they are skipped (lp = H = 0, zero gradient rows); the others are unchanged."""
    logits, targets, w_lp, w_h = _data(6, 24, seed=5, dtype=torch.bfloat16)
    keep = torch.tensor([True, False, True, True, False, False])
    lp_all, ent_all, grad_all = _run_kernel(logits, targets, w_lp, w_h, tau=0.7, block_v=8)
    logits[~keep] = float("nan")
    for mask in (keep, keep.float()):        # bool or numbers (nonzero = keep)
        lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=0.7, block_v=8, row_mask=mask)
        assert torch.equal(lp, torch.where(keep, lp_all, 0.0)) and torch.equal(ent, torch.where(keep, ent_all, 0.0))
        assert torch.equal(grad, torch.where(keep[:, None], grad_all, 0.0))


@kernel_case
def test_public_function_dispatches_to_the_kernel_and_matches_the_torch_path():
    """``kernels="triton"`` and ``kernels="torch"`` of the public function: same values and gradients ([B, S]).

    The kernel really runs: the child process turns a fallback warning into an error (``_interpret.py``)."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(2, 3, 45, generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 45, (2, 3), generator=g)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    w = torch.randn(2, 3, generator=g)
    out = {}
    for kernels in ("torch", "triton"):
        z = logits.to(DEVICE).requires_grad_(True)
        lp, ent = lp_and_entropy(z, targets.to(DEVICE), temperature=0.6, tp_group=None, row_mask=mask.to(DEVICE),
                                 kernels=kernels, chunk_size=2)
        (grad,) = torch.autograd.grad((lp * w.to(DEVICE)).sum() + ent.sum(), z)
        out[kernels] = (lp.cpu(), ent.cpu(), grad.cpu().float())
    for a, b in zip(out["torch"], out["triton"]):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5)  # bf16 gradient: one ulp
    assert (out["triton"][2][mask == 0] == 0).all() and (out["triton"][0][mask == 0] == 0).all()


@kernel_case
@pytest.mark.parametrize("semantics", ["interpreter", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_rows_stay_non_finite_with_either_max(semantics, dtype):
    """NaN / +inf logits and all -inf rows give non-finite log-probs and entropies, as on the torch path.

    ``semantics="gpu"``: elementwise max/min drop NaN as PTX ``max.f32`` does (``gpu_max_semantics``); a clamp
    written as ``max(x, c)`` then turns a NaN logit into a finite one. Rows: NaN off the target (in the second
    column block), NaN target, all NaN, NaN after a -inf block, all -inf, +inf, finite, masked NaN.
    Masked rows keep lp = H = 0 and a zero gradient; rows whose upstream gradients are both 0 (what the loss
    gives a rejected token) get an exactly zero gradient row whatever their logits; the other rows' gradients
    are non-finite exactly where the torch path's are.
    """
    logits, targets, w_lp, w_h = _data(10, 40, seed=9, dtype=dtype)
    nan, inf = float("nan"), float("inf")
    targets[0], logits[0, 21] = 3, nan
    logits[1, targets[1]] = nan
    logits[2] = nan
    logits[3, :16], logits[3, 30] = -inf, nan
    logits[4] = -inf
    logits[5, 7] = inf
    logits[7] = nan
    logits[8, 2] = nan          # rejected: both upstream gradients 0
    logits[9, 5] = -inf         # finite row, zero upstream gradients
    w_lp[8:], w_h[8:] = 0.0, 0.0
    keep = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1, 1], dtype=torch.bool)
    with gpu_max_semantics(semantics == "gpu"):
        lp, ent, grad = _run_kernel(logits, targets, w_lp, w_h, tau=0.8, block_v=16, row_mask=keep)
    z = logits.clone().requires_grad_(True)
    lp_t, ent_t = lp_and_entropy(z, targets, temperature=0.8, tp_group=None, row_mask=keep, kernels="torch")
    (grad_t,) = torch.autograd.grad((lp_t * w_lp).sum() + (ent_t * w_h).sum(), z)
    finite = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 0, 1], dtype=torch.bool)
    for got, ref in ((lp, lp_t), (ent, ent_t)):
        assert torch.equal(torch.isfinite(got), finite) and torch.equal(torch.isfinite(ref), finite), (got, ref)
        assert torch.isnan(got[[0, 1, 2, 3, 5, 8]]).all(), got
    assert lp[7] == 0 and ent[7] == 0 and (grad[7] == 0).all()
    assert (grad[8:] == 0).all() and (grad_t[8:] == 0).all()
    rows_finite = torch.isfinite(grad).all(1)
    assert torch.equal(rows_finite, torch.isfinite(grad_t).all(1)), (rows_finite, grad_t)
    assert torch.equal(rows_finite, torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1, 1], dtype=torch.bool))
    torch.testing.assert_close(lp[6], lp_t[6], rtol=0, atol=2e-5)
    torch.testing.assert_close(grad[6].float(), grad_t[6].float(), **_grad_tol(dtype))


class _FailingLaunch:
    """Stands in for a ``@triton.jit`` kernel that fails to compile or launch (e.g. out of shared memory)."""

    def __init__(self):
        self.calls = 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls += 1
            raise RuntimeError("out of resource: shared memory, Required: 263168, Hardware limit: 232448")
        return launch


@pytest.fixture
def fresh_dispatch():
    reset_dispatch()
    yield
    reset_dispatch()


def _fallback_warnings(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in seen if issubclass(w.category, dispatch.KernelFallbackWarning)]


@kernel_case
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failing_kernel_falls_back_to_torch_with_one_warning(monkeypatch, fresh_dispatch, where):
    """Forward launch fails: the call runs the torch code; backward fails: the torch gradient of the same forward.
    One ``KernelFallbackWarning`` naming the error; the kernel is not tried again in this process."""
    k = _kernels()
    broken = _FailingLaunch()
    monkeypatch.setattr(k, "_lp_fwd_kernel" if where == "forward" else "_lp_bwd_kernel", broken)
    logits, targets, w_lp, w_h = _data(6, 37, seed=10, dtype=torch.bfloat16)
    keep = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)

    def run(kernels):
        z = logits.to(DEVICE, copy=True).requires_grad_(True)
        lp, ent = lp_and_entropy(z, targets.to(DEVICE), temperature=0.7, tp_group=None, row_mask=keep.to(DEVICE),
                                 kernels=kernels)
        (grad,) = torch.autograd.grad((lp * w_lp.to(DEVICE)).sum() + (ent * w_h.to(DEVICE)).sum(), z)
        return lp.cpu(), ent.cpu(), grad.cpu().float()

    got, msgs = _fallback_warnings(lambda: run("triton"))
    assert len(msgs) == 1 and "logprobs" in msgs[0] and "out of resource: shared memory" in msgs[0], msgs
    ref = run("torch")
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5)  # backward case: Triton forward, bf16 gradient
    if where == "forward":
        assert all(torch.equal(a, b) for a, b in zip(got, ref))  # the torch code itself
    again, msgs = _fallback_warnings(lambda: run("triton"))
    assert msgs == [] and broken.calls == 1  # no retry, no second warning
    for a, b in zip(again, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@kernel_case
def test_empty_input():
    k = _kernels()
    z = torch.zeros(0, 8, device=DEVICE, requires_grad=True)
    lp, ent = k.fused_log_probs_and_entropy(z, torch.zeros(0, dtype=torch.long, device=DEVICE))
    assert lp.shape == ent.shape == (0,)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), z)
    assert grad.shape == (0, 8)


@pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA GPU")
def test_no_host_synchronisation_on_cuda():
    logits, targets, w_lp, w_h = _data(64, 1000, seed=7, dtype=torch.bfloat16)
    z = logits.cuda().requires_grad_(True)
    t, mask, w = targets.cuda(), (torch.arange(64) % 2 == 0).cuda(), w_h.cuda()
    _run_kernel(logits, targets, w_lp, w_h)   # compile outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        lp, ent = lp_and_entropy(z, t, temperature=0.7, tp_group=None, row_mask=mask)
        torch.autograd.backward([lp, ent], [w, w])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(z.grad).all()


# ------------------------------------------------------------------------------------------ launchers
@pytest.mark.skipif(INTERPRETED, reason="this is the interpreter run itself")
def test_kernel_cases_under_triton_interpreter():
    """Runs this module's kernel cases on CPU in a child process with TRITON_INTERPRET=1; all must pass."""
    pytest.importorskip("triton")
    assert_module_passes_under_interpreter(__file__, N_KERNEL_CASES)


@pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) kernels")
def test_kernels_compile_for_h100():
    """Both kernels lower to sm_90 machine code (bf16 logits, every constexpr branch) without a GPU."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    if not isinstance(k._lp_fwd_kernel, triton.runtime.JITFunction):
        pytest.skip("the kernels module was imported under TRITON_INTERPRET=1 in this process")
    aligned = [["tt.divisibility", 16]]
    fwd_sig = {"z_ptr": "*bf16", "z_stride": "i64", "tgt_ptr": "*i64", "mask_ptr": "*u8", "o0_ptr": "*fp32",
               "o1_ptr": "*fp32", "o2_ptr": "*fp32", "o3_ptr": "*fp32", "vocab_start": "i64", "inv_tau": "fp32",
               "n_cols": "constexpr", "HAS_MASK": "constexpr", "WITH_ENTROPY": "constexpr", "FINAL": "constexpr",
               "BLOCK_V": "constexpr"}
    bwd_sig = {"z_ptr": "*bf16", "z_stride": "i64", "g_ptr": "*bf16", "g_stride": "i64", "tgt_ptr": "*i64",
               "mask_ptr": "*u8", "logz_ptr": "*fp32", "h_ptr": "*fp32", "glp_ptr": "*fp32", "gh_ptr": "*fp32",
               "vocab_start": "i64", "inv_tau": "fp32", "n_cols": "constexpr", "HAS_MASK": "constexpr",
               "HAS_GLP": "constexpr", "HAS_GH": "constexpr", "BLOCK_V": "constexpr"}
    block = k.default_block_v(32000)
    cases = [(k._lp_fwd_kernel, fwd_sig, dict(HAS_MASK=m, WITH_ENTROPY=e, FINAL=f))
             for m, e, f in [(True, True, True), (False, False, False)]]
    cases += [(k._lp_bwd_kernel, bwd_sig, dict(HAS_MASK=True, HAS_GLP=True, HAS_GH=True)),
              (k._lp_bwd_kernel, bwd_sig, dict(HAS_MASK=False, HAS_GLP=True, HAS_GH=False)),
              (k._lp_bwd_kernel, bwd_sig, dict(HAS_MASK=False, HAS_GLP=False, HAS_GH=True))]
    for fn, sig, flags in cases:
        src = ASTSource(fn=fn, signature=sig, constexprs=dict(n_cols=32000, BLOCK_V=block, **flags),
                        attrs={(i,): aligned for i in range(4)})
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": k._num_warps(block)})
        ptx = compiled.asm["ptx"]
        assert compiled.asm["cubin"] and "ld.global.v4" in ptx, f"{fn.__name__} {flags}: no 16-byte loads"


@pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) kernels")
def test_gpu_max_semantics_premise_on_sm90():
    """What ``gpu_max_semantics`` emulates: on sm_90 ``tl.maximum`` is PTX ``max.f32`` (NaN-dropping; ``max.NaN``
    only on request), and the kernels' NaN-keeping floor (a selection) compiles to no ``max`` at all."""
    triton = pytest.importorskip("triton")
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    k = _kernels()
    if not isinstance(k._lp_fwd_kernel, triton.runtime.JITFunction):
        pytest.skip("the kernels module was imported under TRITON_INTERPRET=1 in this process")

    @triton.jit
    def plain_max(x_ptr, y_ptr, BLOCK: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, BLOCK))
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.maximum(x, -200.0))

    @triton.jit
    def nan_max(x_ptr, y_ptr, BLOCK: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, BLOCK))
        tl.store(y_ptr + tl.arange(0, BLOCK), tl.maximum(x, -200.0, propagate_nan=tl.PropagateNan.ALL))

    @triton.jit
    def floor(x_ptr, y_ptr, BLOCK: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, BLOCK))
        tl.store(y_ptr + tl.arange(0, BLOCK), k._floor(x, -200.0))

    def ptx(fn):
        sig = {"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs={"BLOCK": 128}),
                              target=GPUTarget("cuda", 90, 32)).asm["ptx"]

    plain, propagating, selected = ptx(plain_max), ptx(nan_max), ptx(floor)
    assert "max.f32" in plain and "max.NaN" not in plain, plain
    assert "max.NaN.f32" in propagating, propagating
    assert "max." not in selected and "selp" in selected, selected


# ------------------------------------------------------------------------------------------ torch reference
def test_torch_path_minus_inf_logits_with_any_entropy_weight():
    """d H / d z at a -inf logit is 0 for any upstream gradient (the torch path used to give NaN for |g_H| > 1)."""
    logits = torch.randn(3, 12)
    logits[:, 8:] = float("-inf")
    z = logits.requires_grad_(True)
    lp, ent = lp_and_entropy(z, torch.tensor([0, 3, 7]), temperature=0.8, tp_group=None, kernels="torch")
    (grad,) = torch.autograd.grad(lp.sum() + 3.0 * ent.sum(), z)
    assert torch.isfinite(grad).all() and (grad[:, 8:] == 0).all()
    z64, lp_ref, ent_ref = _oracle(logits[:, :8], torch.tensor([0, 3, 7]), 0.8)
    (g_ref,) = torch.autograd.grad(lp_ref.sum() + 3.0 * ent_ref.sum(), z64)
    torch.testing.assert_close(grad[:, :8].double(), g_ref, rtol=0, atol=2e-6)


def test_torch_path_row_mask():
    """Masked rows: 0 values, zero gradient rows, even with NaN logits there; others as without the mask."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 10, generator=g)
    targets = torch.randint(0, 10, (5,), generator=g)
    keep = torch.tensor([1, 0, 1, 0, 1])
    z = logits.clone().requires_grad_(True)
    lp_all, ent_all = lp_and_entropy(z, targets, tp_group=None, kernels="torch", chunk_size=2)
    (g_all,) = torch.autograd.grad(lp_all.sum() + ent_all.sum(), z)
    logits[keep == 0] = float("nan")
    z = logits.requires_grad_(True)
    lp, ent = lp_and_entropy(z, targets, tp_group=None, kernels="torch", chunk_size=2, row_mask=keep)
    (grad,) = torch.autograd.grad(lp.sum() + ent.sum(), z)
    assert torch.equal(lp, torch.where(keep == 1, lp_all, 0.0))
    assert torch.equal(ent, torch.where(keep == 1, ent_all, 0.0))
    assert torch.equal(grad, torch.where(keep[:, None] == 1, g_all, 0.0))


def test_bad_kernels_and_row_mask_are_named():
    with pytest.raises(ValueError, match=r"kernels must be one of 'torch', 'triton', got 'cuda'"):
        lp_and_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), tp_group=None, kernels="cuda")
    with pytest.raises(ValueError, match=r"row_mask shape \(3,\) must equal targets shape \(2,\)"):
        lp_and_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), tp_group=None, row_mask=torch.ones(3))


@pytest.mark.skipif(INTERPRETED, reason="needs compiled (not interpreted) kernels")
def test_triton_on_cpu_without_interpreter_warns_once_and_runs_torch():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    reset_dispatch()
    z, y = torch.randn(2, 4), torch.zeros(2, dtype=torch.long)
    with pytest.warns(dispatch.KernelFallbackWarning, match="logprobs kernel cannot run .*need CUDA tensors"):
        lp, ent = lp_and_entropy(z, y, tp_group=None, kernels="triton")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        lp2, ent2 = lp_and_entropy(z, y, tp_group=None, kernels="triton")
    ref = lp_and_entropy(z, y, tp_group=None, kernels="torch")
    assert torch.equal(lp, ref[0]) and torch.equal(ent, ref[1]) and torch.equal(lp2, lp) and torch.equal(ent2, ent)
    reset_dispatch()


@pytest.mark.skipif(INTERPRETED, reason="runs once, in the parent process")
def test_works_without_triton():
    """triton unimportable: the torch code never imports the kernels; kernels="triton" warns once and runs it."""
    code = (
        "import sys, warnings; sys.modules['triton'] = None\n"  # `import triton` now raises ImportError
        "import torch\n"
        "from slime_tis.kernels.dispatch import KernelFallbackWarning\n"
        "from slime_tis.megatron import vocab_parallel_log_probs_and_entropy as f\n"
        "z, y = torch.randn(3, 7), torch.tensor([0, 1, 6])\n"
        "lp, ent = f(z, y, tp_group=None)\n"
        "assert torch.isfinite(lp).all() and 'slime_tis.kernels.logprobs' not in sys.modules\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    lp_t, _ = f(z, y, tp_group=None, kernels='triton')\n"
        "    f(z, y, tp_group=None, kernels='triton')\n"
        "msgs = [str(w.message) for w in seen if w.category is KernelFallbackWarning]\n"
        "assert len(msgs) == 1 and 'triton is not importable' in msgs[0], msgs\n"
        "assert torch.equal(lp_t, lp)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
