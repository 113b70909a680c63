"""The fused CPU kernels (slime_tis.core.native) against the torch reference path.

The torch path (``SLIME_TIS_NATIVE=0``) is the reference: both must give the same per-sequence sums,
the same keep masks and weights, the same diagnostics and the same loss and gradient, on batches
with NaN/inf at valid and masked positions, zero-length sequences and lengths that are not
multiples of the kernel's vector width. The build/fallback behaviour runs in fresh subprocesses.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_properties import configs, lp_train_of, packed_batches

from slime_tis import TISConfig, compute_tis, policy_loss
from slime_tis.core import native
from slime_tis.core.ratios import (
    ROW_E,
    ROW_K3,
    ROW_LOG_RATIO,
    ROW_LP_ROLLOUT,
    ROW_NONFINITE,
    ROW_VALID,
    ROW_VETO,
    _torch_sums,
)
from slime_tis.core.segments import Segments

ROOT = Path(__file__).resolve().parents[1]
HAS_CC = shutil.which(os.environ.get("CC", "cc")) is not None


@pytest.fixture(autouse=True)
def _native_auto(monkeypatch):
    monkeypatch.setenv("SLIME_TIS_NATIVE", "auto")


def test_kernels_build_here():
    """A machine with a C compiler must get the fused kernels (else every test below is vacuous)."""
    if not HAS_CC:
        pytest.skip("no C compiler on this machine")
    assert native.available(), "the fused CPU kernels did not build: see the slime_tis warning above"
    assert native.library_path().exists()


def _both(fn, monkeypatch):
    """``fn()`` with the fused kernels and with the torch path."""
    monkeypatch.setenv("SLIME_TIS_NATIVE", "1")
    fused = fn()
    monkeypatch.setenv("SLIME_TIS_NATIVE", "0")
    reference = fn()
    monkeypatch.setenv("SLIME_TIS_NATIVE", "auto")
    return fused, reference


def _layout(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    return cu


def test_sequence_sums_match_torch_on_hostile_batch():
    """Columns 0-4 equal the torch path's; NaN/inf at valid tokens count, at masked tokens vanish."""
    g = torch.Generator().manual_seed(1)
    lengths = [0, 1, 7, 8, 9, 0, 513, 1030, 3, 64]  # tails, empty sequences, > one 512-token block
    cu = _layout(lengths)
    n = int(cu[-1])
    lr = -6.0 * torch.rand(n, generator=g)
    lt = lr + 0.05 * torch.randn(n, generator=g)
    valid = torch.rand(n, generator=g) < 0.8
    adv = torch.randn(n, generator=g)
    for t in (lt, lr, adv):
        hit = torch.rand(n, generator=g) < 0.01
        t[hit] = torch.tensor([math.nan, math.inf, -math.inf])[torch.randint(0, 3, (int(hit.sum()),), generator=g)]
    segments = Segments(cu, n, lt.device)
    fused = native.sequence_sums(lt, lr, valid, cu, (adv,), log_veto=math.log(0.97), moments_bound=20.0)
    reference, _ = _torch_sums(lt, lr, valid, segments, math.log(0.97), (adv,))
    counts = [ROW_VALID, ROW_NONFINITE, ROW_VETO]
    assert torch.equal(fused[:, counts], reference[:, counts])
    assert fused[:, ROW_NONFINITE].sum() > 0  # the batch did exercise the non-finite rule
    assert fused[:, ROW_VETO].sum() > 0
    torch.testing.assert_close(fused[:, [ROW_LOG_RATIO, ROW_LP_ROLLOUT]], reference[:, [ROW_LOG_RATIO, ROW_LP_ROLLOUT]],
                               rtol=1e-6, atol=1e-5)
    assert torch.isfinite(fused).all()
    assert fused[0].abs().sum() == 0 and fused[5].abs().sum() == 0  # zero-length sequences


def test_moments_match_float64_expm1():
    """e = expm1(clamp(l, -B, B)) per token against float64, across the whole clamped range."""
    bound = 30.0
    log_ratio = torch.cat([torch.linspace(-40.0, 40.0, 4001), torch.tensor([0.0, 1e-7, -1e-7, 1e-3, 0.3466, -0.3466])])
    lr = torch.full_like(log_ratio, -2.0)
    lt = lr + log_ratio
    n = log_ratio.numel()
    cu = torch.arange(n + 1, dtype=torch.int64)  # one token per sequence: column = that token's value
    out = native.sequence_sums(lt, lr, torch.ones(n, dtype=torch.bool), cu, moments_bound=bound)
    lc = (lt - lr).double().clamp(-bound, bound)  # the float32 l the kernel sees, widened
    e = torch.expm1(lc)
    torch.testing.assert_close(out[:, ROW_E], e, rtol=3e-7, atol=0.0)
    torch.testing.assert_close(out[:, ROW_K3], e - lc, rtol=1e-6, atol=1e-12 + 1e-7 * float(lc.abs().max()))


def test_malformed_offsets_never_read_outside_the_batch():
    """Offsets past T or going backwards are clamped: sums cover [cu_i, cu_i+1) within [prev, T]."""
    lr = torch.zeros(10)
    lt = torch.arange(10, dtype=torch.float32)
    valid = torch.ones(10, dtype=torch.bool)
    cu = torch.tensor([0, 5, 3, 10**9], dtype=torch.int64)
    out = native.sequence_sums(lt, lr, valid, cu)
    assert out[:, ROW_LOG_RATIO].tolist() == [10.0, 0.0, 35.0]
    assert out[:, ROW_VALID].tolist() == [5.0, 0.0, 5.0]
    values, keep = native.expand(cu, valid, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([True, False, True]))
    assert values.tolist() == [1.0] * 5 + [3.0] * 5
    assert keep.tolist() == [True] * 10


def test_wrong_lengths_dtypes_or_devices_raise_before_the_c_code():
    cu = _layout([2, 3])
    lt, valid = torch.zeros(5), torch.ones(5, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"lp_rollout must be a 1-D torch.float32 CPU tensor of 5 elements.*\(4,\)"):
        native.sequence_sums(lt, torch.zeros(4), valid, cu)
    with pytest.raises(ValueError, match=r"extras\[0\] must be a 1-D torch.float32 .* got \(5,\) torch.float64"):
        native.sequence_sums(lt, lt, valid, cu, (torch.zeros(5, dtype=torch.float64),))
    with pytest.raises(ValueError, match=r"offsets must be a 1-D torch.int64"):
        native.sequence_sums(lt, lt, valid, cu.int())
    with pytest.raises(ValueError, match=r"value must be a 1-D torch.float32 CPU tensor of 2 elements"):
        native.expand(cu, valid, torch.zeros(3), torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"valid must be a 1-D torch.bool"):
        native.expand(cu, valid.float(), torch.zeros(2), torch.ones(2, dtype=torch.bool))


def test_expand_zeroes_invalid_tokens():
    cu = _layout([3, 0, 4])
    valid = torch.tensor([1, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
    values, keep = native.expand(cu, valid, torch.tensor([0.5, 9.0, 2.0]), torch.tensor([False, True, True]))
    assert values.tolist() == [0.5, 0.0, 0.5, 2.0, 2.0, 0.0, 2.0]
    assert keep.tolist() == [False, False, False, True, True, False, True]


def _assert_tis_equal(fused, reference):
    assert torch.equal(fused.keep_mask, reference.keep_mask)
    torch.testing.assert_close(fused.weights, reference.weights, rtol=2e-5, atol=1e-7)
    a, b = fused.stats.finalize(), reference.stats.finalize()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=2e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=packed_batches(), config=configs())
def test_compute_tis_fused_equals_torch(batch, config, monkeypatch):
    lp_train = lp_train_of(config, batch)
    fused, reference = _both(lambda: compute_tis(config, lp_train, batch.lp_rollout, batch.mask, batch.cu,
                                                 extra_finite=(batch.advantages,)), monkeypatch)
    _assert_tis_equal(fused, reference)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=packed_batches(), config=configs(), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_policy_loss_and_gradient_fused_equal_torch(batch, config, dtype, monkeypatch):
    def run():
        theta = batch.lp_theta.to(dtype).clone().requires_grad_(True)
        out = policy_loss(config, theta, batch.lp_old.to(dtype), batch.lp_rollout.to(dtype), batch.advantages,
                          batch.mask, batch.cu)
        out.loss.backward()
        return out.loss.detach(), theta.grad, out.keep_mask, out.stats.finalize()

    (loss_a, grad_a, keep_a, m_a), (loss_b, grad_b, keep_b, m_b) = _both(run, monkeypatch)
    assert torch.equal(keep_a, keep_b)
    torch.testing.assert_close(loss_a, loss_b, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(grad_a, grad_b, rtol=2e-5, atol=1e-6)
    assert m_a.keys() == m_b.keys()
    for key in m_a:
        torch.testing.assert_close(m_a[key], m_b[key], rtol=2e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_long_sequence_weight_matches_torch(monkeypatch):
    """Sequence-level weights of 100k-token sequences: float32 block sums stay within 1e-6 of float64."""
    g = torch.Generator().manual_seed(3)
    cu = _layout([100_000, 60_000, 5])
    n = int(cu[-1])
    lr = -3.0 * torch.rand(n, generator=g)
    lt = lr + 1e-3 + 0.02 * torch.randn(n, generator=g)
    config = TISConfig(use_tis=True, level="sequence", mode="clip", lower=1e-30, upper=1e30, safety_bound=200.0)
    mask = torch.ones(n, dtype=torch.bool)
    fused, reference = _both(lambda: compute_tis(config, lt, lr, mask, cu), monkeypatch)
    torch.testing.assert_close(fused.ratios.seq_log_ratio_sum, reference.ratios.seq_log_ratio_sum, rtol=1e-6, atol=1e-4)


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env,
                          timeout=300)


def test_without_compiler_auto_falls_back_and_required_raises(tmp_path):
    code = """
        import torch
        from slime_tis import TISConfig, compute_tis
        from slime_tis.core import native
        out = compute_tis(TISConfig(use_tis=True), torch.zeros(3), torch.zeros(3), torch.ones(3), torch.tensor([0, 3]))
        print("available", native.available(), "weights", out.weights.tolist())
    """
    env = {"CC": str(tmp_path / "no-such-cc"), "SLIME_TIS_CACHE": str(tmp_path / "cache")}
    auto = _python(code, SLIME_TIS_NATIVE="auto", **env)
    assert auto.returncode == 0, auto.stderr
    assert "available False weights [1.0, 1.0, 1.0]" in auto.stdout
    assert "fused CPU kernels unavailable, using the torch path" in auto.stderr
    assert "no-such-cc" in auto.stderr
    required = _python(code, SLIME_TIS_NATIVE="1", **env)
    assert required.returncode != 0
    assert "NativeBuildError: SLIME_TIS_NATIVE=1 but the CPU kernels are unavailable" in required.stderr
    bogus = _python(code, SLIME_TIS_NATIVE="yes", **env)
    assert "SLIME_TIS_NATIVE = 'yes': must be 'auto', '0' or '1'" in bogus.stderr


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_unwritable_cache_builds_in_the_temp_dir(tmp_path):
    """A cache path that cannot be a directory (here: under a regular file) falls back to $TMPDIR."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    code = """
        from slime_tis.core import native
        assert native.available()
        print(native._lib._name)
    """
    done = _python(code, SLIME_TIS_NATIVE="1", SLIME_TIS_CACHE=str(blocker / "cache"), TMPDIR=str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "cannot write" in done.stderr and str(blocker / "cache") in done.stderr
    built = Path(done.stdout.strip())
    assert built.parent.parent == tmp_path and built.parent.name.startswith("slime_tis-") and built.exists()


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_concurrent_first_builds_share_one_library(tmp_path):
    """Ranks starting together on an empty cache each build atomically and all load a whole library."""
    code = """
        from slime_tis.core import native
        assert native.available()
        print(native.library_path())
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SLIME_TIS_CACHE": str(tmp_path), "SLIME_TIS_NATIVE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    assert sorted(f.name for f in tmp_path.iterdir()) == [Path(paths.pop()).name]  # no temporary left behind
