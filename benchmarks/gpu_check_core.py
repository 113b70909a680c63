"""GPU check of the pure core: ``policy_loss`` forward + backward + metric merge/finalize makes no host sync.

    python benchmarks/gpu_check_core.py [--json out.json]   # CUDA; exits 0 with a message elsewhere
    python benchmarks/gpu_check_core.py --device cpu        # smoke run: 2000 tokens, Triton interpreter, no sync check

Runs every algorithm with rejection, veto, batch-norm, drop denominators and the three levels on a 200k-token
packed batch under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising call raises) and prints one
line per configuration, once with ``cu_seqlens`` on the GPU and once on the CPU (converted once per tensor,
asynchronously). Finally a bad ``cu_seqlens`` on the GPU must trip the device-side assertion (run last, in a
child process: a device assertion ends the CUDA context; on CPU the same offsets must raise). Exit 1 on any
failure; ``--json`` writes the verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if "cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # --device cpu: the Triton token pass under the interpreter
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slime_tis import TISConfig, policy_loss  # noqa: E402

CONFIGS = [
    TISConfig(),
    TISConfig(use_rollout_log_probs=True, mode="mask", rs_level="token", veto_threshold=1e-4),
    TISConfig(use_tis=True, level="sequence", mode="clip", batch_normalize=True, loss_agg="seq-mean-token-mean"),
    TISConfig(use_tis=True, level="token", mode="mask", rejected_denominator="drop", rs_level="geometric"),
    TISConfig(use_rollout_log_probs=True, use_tis=True, level="geometric", mode="mask", upper=1.05,
              veto_threshold=1e-4, batch_normalize=True),
    TISConfig(use_rollout_log_probs=True, seq_mean_k3_threshold=0.01, seq_max_k3_threshold=1.0),
]


class _SyncDebug:
    """``torch.cuda.set_sync_debug_mode(mode)`` on CUDA; nothing on CPU (no host sync to catch there)."""

    @staticmethod
    def set(mode: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode(mode)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check_core: CUDA is not available; skipping (exit 0).")
        return 0
    dev = args.device
    n_tok, n_seq = (200_000, 400) if dev == "cuda" else (2000, 20)
    verdicts: dict[str, str] = {}
    g = torch.Generator(device=dev).manual_seed(0)
    cu = torch.arange(0, n_tok + 1, n_tok // n_seq, device=dev)
    lp_rollout = -torch.rand(n_tok, device=dev, generator=g) * 3
    lp_old = lp_rollout + 0.05 * torch.randn(n_tok, device=dev, generator=g)
    adv = torch.randn(n_tok, device=dev, generator=g)
    mask = torch.rand(n_tok, device=dev, generator=g) < 0.9
    failures = 0
    for cfg, cu in [(c, cu) for c in CONFIGS] + [(c, cu.cpu()) for c in CONFIGS]:
        theta = (lp_old + 0.01 * torch.randn(n_tok, device=dev, generator=g)).requires_grad_(True)
        policy_loss(cfg, theta, lp_old, lp_rollout, adv, mask, cu)  # warm-up (allocator, kernels)
        if dev == "cuda":
            torch.cuda.synchronize()
        _SyncDebug.set("error")
        name = f"algorithm {cfg.algorithm} {cfg.mode}/{cfg.level} cu on {cu.device}"
        try:
            out = policy_loss(cfg, theta, lp_old, lp_rollout, adv, mask, cu, denominator=1000.0)
            out.loss.backward()
            out.stats.merge(out.stats).finalize()
            verdicts[name] = "no host sync" if dev == "cuda" else "ran (host sync not checked on cpu)"
        except RuntimeError as exc:
            failures += 1
            verdicts[name] = f"HOST SYNC: {str(exc).splitlines()[0]}"
        finally:
            _SyncDebug.set("default")
        print(f"{name}: {verdicts[name]}")
    failures += triton_matches_torch(lp_old, lp_rollout, adv, mask, cu, verdicts)
    failures += bad_offsets_trip_device_assert(dev, verdicts)
    if args.json:
        args.json.write_text(json.dumps({"device": dev, "failures": failures, "checks": verdicts}, indent=2))
    return 1 if failures else 0


def triton_matches_torch(lp_old, lp_rollout, adv, mask, cu, verdicts: dict) -> int:
    """The opt-in Triton token pass (``kernels="triton"``) gives the torch path's loss and metrics, no sync."""
    import warnings

    from slime_tis.kernels.dispatch import KernelFallbackWarning

    failures = 0
    for cfg in CONFIGS:
        outs = []
        for mode in ("torch", "triton"):
            theta = lp_old.clone().requires_grad_(True)
            _SyncDebug.set("error" if mode == "triton" and outs else "default")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", KernelFallbackWarning)  # the kernel must really run
                    out = policy_loss(cfg.replace(kernels=mode), theta, lp_old, lp_rollout, adv, mask, cu)
            finally:
                _SyncDebug.set("default")
            outs.append((out.loss.detach(), out.stats.finalize()))
        (la, ma), (lb, mb) = outs
        ok = torch.allclose(la, lb, rtol=1e-5, atol=1e-7) and all(
            torch.allclose(ma[k], mb[k], rtol=1e-6, atol=1e-9) for k in ma)
        failures += not ok
        name = f"triton token pass, algorithm {cfg.algorithm} {cfg.mode}/{cfg.level}"
        verdicts[name] = "same as torch" if ok else "DIFFERS from torch"
        print(f"{name}: {verdicts[name]}")
    return failures


def bad_offsets_trip_device_assert(dev: str, verdicts: dict) -> int:
    """cu_seqlens ending past T must fail: on CUDA a device-side assertion, in a child process; on CPU an error."""
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    code = (f"import torch, sys; sys.path.insert(0, {root!r}); from slime_tis import TISConfig, compute_tis; "
            f"x = torch.zeros(10, device={dev!r}); cu = torch.tensor([0, 4, 12], device={dev!r}); "
            "r = compute_tis(TISConfig(use_tis=True), x, x, x > -1, cu); "
            "torch.cuda.synchronize() if x.is_cuda else None")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    log = (proc.stderr + proc.stdout).lower()
    tripped = proc.returncode != 0 and ("assert" in log or "cu_seqlens" in log)
    verdicts[f"bad cu_seqlens on {dev}"] = "refused (ok)" if tripped else "NOT DETECTED"
    print(f"bad cu_seqlens on {dev}: {verdicts[f'bad cu_seqlens on {dev}']}")
    return 0 if tripped else 1


if __name__ == "__main__":
    raise SystemExit(main())
