"""Speed of the correction core vs verl 0.9.1, side by side, on the same logical batches: one run, one table.

Configurations (``CONFIGS``; ours: a ``TISConfig``, verl: kwargs of ``compute_rollout_correction_and_rejection_mask``):

* token truncate (default): ``use_tis`` truncate token upper 2 | ``rollout_is="token"``, threshold 2.0;
* sequence truncate: ``level="sequence"`` | ``rollout_is="sequence"``;
* sequence mask + sequence RS, both [0.5, 2] | ``rollout_is="sequence"`` "0.5_2.0" (IcePop masking) +
  ``rollout_rs="seq_sum_k1"`` "0.5_2.0";
* geometric mask [0.999, 1.001] + veto 1e-4 | ``rollout_rs="seq_mean_k1,seq_max_k3"`` (verl has no veto; its
  ``seq_max_k3`` at the k3 of a 1e-4 ratio is the nearest rule);
* token clip + token RS + batch-norm, [0.5, 2] | ``rollout_is="token"`` 2.0 batch-normalised + ``token_k1``.

What is timed: verl on the padded ``[B, L]`` batch, returning its metrics as Python floats (it reads each
with ``.item()``); ours on the packed batch: ``compute_tis`` with all diagnostics, ``stats.finalize()`` and
(CPU) one transfer of all metric values to the host, as a logger does. Inputs are prepared outside the
timed region. Both sides alternate within every repeat (shared machines drift) and the minimum over the
repeats is kept.

Batches (lengths uniform in ``[L/4, L]`` unless fixed; ~10% inner masked tokens; a few catastrophic
tokens with ratio ~1e-5): ``256x2048`` and ``1024x1024`` (``[B, L]``); ``4096x128`` short vs ``256x2048``
long at equal tokens (fixed lengths) for "cost follows tokens": ours on both, timed interleaved.
``--device cuda``: ``4096x256`` and ``256x4096`` (fixed lengths, 1M tokens), ours under
``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises) and without the final host read.

Targets: CPU >= 2.5x verl on every row, short/long within 1.5x; H100 <= 0.3 ms per 1M-token row, >= 5x verl.

    python benchmarks/bench_correction.py                       # CPU table (2 threads)
    python benchmarks/bench_correction.py --device cuda         # GPU table
    python benchmarks/bench_correction.py --write docs/bench_correction.md --label cpu
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]
import _verl_light  # noqa: E402,F401  (stubs ray/transformers before verl is imported)
import verl.trainer.ppo.rollout_corr_helper as rc  # noqa: E402

from slime_tis import TISConfig, compute_tis, padded_to_packed  # noqa: E402

_VETO = 1e-4
_K3_OF_VETO = _VETO - 1.0 - math.log(_VETO)  # k3 of a token at ratio 1e-4: verl's seq_max_k3 stand-in for the veto

CONFIGS: list[tuple[str, TISConfig, dict[str, Any]]] = [
    ("token truncate (default)", TISConfig(use_tis=True),
     dict(rollout_is="token", rollout_is_threshold=2.0)),
    ("sequence truncate", TISConfig(use_tis=True, level="sequence"),
     dict(rollout_is="sequence", rollout_is_threshold=2.0)),
    ("sequence mask + sequence RS",
     TISConfig(use_tis=True, mode="mask", level="sequence", lower=0.5, upper=2.0, rs_level="sequence",
               rs_lower=0.5, rs_upper=2.0),
     dict(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_rs="seq_sum_k1",
          rollout_rs_threshold="0.5_2.0")),
    ("geometric mask + veto",
     TISConfig(use_tis=True, mode="mask", level="geometric", lower=0.999, upper=1.001, veto_threshold=_VETO),
     dict(rollout_rs="seq_mean_k1,seq_max_k3", rollout_rs_threshold=f"0.999_1.001,{_K3_OF_VETO}")),
    ("token clip + token RS + batch-norm",
     TISConfig(use_tis=True, mode="clip", level="token", lower=0.5, upper=2.0, rs_level="token", rs_lower=0.5,
               rs_upper=2.0, batch_normalize=True),
     dict(rollout_is="token", rollout_is_threshold=2.0, rollout_is_batch_normalize=True, rollout_rs="token_k1",
          rollout_rs_threshold="0.5_2.0")),
]


@dataclass(frozen=True)
class Shape:
    name: str
    n_seq: int
    max_len: int
    min_len: int


CPU_SHAPES = [Shape("256x2048", 256, 2048, 512), Shape("1024x1024", 1024, 1024, 256)]
CPU_SPREAD = (Shape("4096x128 short", 4096, 128, 128), Shape("256x2048 long", 256, 2048, 2048))
GPU_SHAPES = [Shape("4096x256", 4096, 256, 256), Shape("256x4096", 256, 4096, 4096)]


@dataclass
class Inputs:
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # lp_old, lp_rollout, mask (float) [B, L]
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # lp_old, lp_rollout, mask, cu
    tokens: int


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> Inputs:
    """Random log-probs: per-token sd 0.02 + per-sequence drift, ~10% inner masked tokens, a few
    catastrophic tokens (log-ratio -11.5); padding positions hold garbage."""
    g = torch.Generator().manual_seed(seed)
    b, n = shape.n_seq, shape.max_len
    lengths = torch.randint(shape.min_len, shape.max_len + 1, (b,), generator=g)
    pos = torch.arange(n)[None, :]
    inner = (torch.rand(b, n, generator=g) < 0.1) & (pos > 0) & (pos < lengths[:, None] - 1)
    mask = ((pos < lengths[:, None]) & ~inner).float()
    lp_rollout = -6.0 * torch.rand(b, n, generator=g) ** 2
    lp_old = lp_rollout + 1e-3 * torch.randn(b, 1, generator=g) + 0.02 * torch.randn(b, n, generator=g)
    catastrophic = torch.rand(b, n, generator=g) < 2e-5
    lp_old = torch.where(catastrophic, lp_rollout - 11.5, lp_old)
    p_old, cu = padded_to_packed(lp_old, mask)
    p_rollout, _ = padded_to_packed(lp_rollout, mask)
    p_mask = padded_to_packed(mask, mask)[0] != 0
    to = lambda *ts: tuple(t.to(device).contiguous() for t in ts)  # noqa: E731
    return Inputs(to(lp_old, lp_rollout, mask), to(p_old, p_rollout, p_mask, cu), int(mask.sum()))


def run_verl(kwargs: dict[str, Any], inputs: Inputs) -> dict[str, float]:
    old, rollout, mask = inputs.padded
    return rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **kwargs)[2]


def run_ours(cfg: TISConfig, inputs: Inputs, read: bool = True) -> Any:
    res = compute_tis(cfg, *inputs.packed)
    metrics = res.stats.finalize()
    if read:
        return torch.stack(list(metrics.values())).tolist()  # host-sync-ok: the logger's single read
    return metrics


CLOCK = time.perf_counter


def time_interleaved(fns: list[Callable[[], object]], device: torch.device, repeats: int,
                     no_sync: tuple[bool, ...] = ()) -> list[float]:
    """Minimum time (ms, ``CLOCK``) of each function, alternating within every repeat (one warm-up round first).
    ``no_sync[i]``: run function ``i`` under ``torch.cuda.set_sync_debug_mode("error")``."""
    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in fns]
    for rep in range(repeats + 1):
        for i, fn in enumerate(fns):
            if cuda:
                torch.cuda.synchronize()
            start = CLOCK()
            guard = cuda and i < len(no_sync) and no_sync[i]
            if guard:
                torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
            finally:
                if guard:
                    torch.cuda.set_sync_debug_mode("default")
            if cuda:
                torch.cuda.synchronize()
            if rep:
                times[i].append((CLOCK() - start) * 1e3)
    return [min(t) for t in times]


def check_agreement(cfg: TISConfig, kwargs: dict[str, Any], inputs: Inputs, label: str) -> None:
    """Sanity before timing: both sides report the same token KL (else the timing is moot)."""
    ours = float(compute_tis(cfg, *inputs.packed).stats.finalize()["tis/kl"])  # host-sync-ok (check)
    verl = run_verl(kwargs, inputs)["rollout_corr/kl"]
    if abs(ours - verl) > 1e-4 * max(abs(verl), 1e-6):
        raise SystemExit(f"{label}: tis/kl {ours} vs verl {verl}: the two sides disagree")


def environment(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu}"
    clock = "process CPU time" if CLOCK is time.process_time else "wall time"
    return (f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores "
            f"visible; python {platform.python_version()}; {clock}; load average {os.getloadavg()[0]:.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--repeats", type=int, default=9, help="timed rounds (minimum kept; default 9)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (all threads), robust on a loaded "
                             "shared box where wall time mostly measures waiting (CPU only)")
    parser.add_argument("--write", type=Path, default=None, help="also write the table into this markdown file")
    parser.add_argument("--label", default=None, help="block of --write to replace (default: the device type)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and verdicts here")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny batches, one round (the acceptance script's CPU smoke run; times mean nothing)")
    parser.add_argument("--kernels", choices=["torch", "triton"], default="torch",
                        help="TISConfig.kernels of our runs: the torch token pass (default) or the Triton kernel "
                             "(a fallback to torch is an error here)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.kernels == "triton":
        import warnings

        from slime_tis.kernels.dispatch import KernelFallbackWarning
        warnings.simplefilter("error", KernelFallbackWarning)
        global CONFIGS
        CONFIGS = [(label, cfg.replace(kernels="triton"), kwargs) for label, cfg, kwargs in CONFIGS]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" and not cuda else time.perf_counter
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")

    rows, verdicts = [], []
    shapes = GPU_SHAPES if cuda else CPU_SHAPES
    if args.cpu_smoke:
        shapes, args.repeats = [Shape("64x64", 64, 64, 16)], 1
    for shape in shapes:
        inputs = make_inputs(shape, device)
        for label, cfg, kwargs in CONFIGS:
            check_agreement(cfg, kwargs, inputs, label)
            verl_ms, ours_ms = time_interleaved(
                [lambda k=kwargs, i=inputs: run_verl(k, i), lambda c=cfg, i=inputs: run_ours(c, i, read=not cuda)],
                device, args.repeats, no_sync=(False, True))
            rows.append((label, shape.name, inputs.tokens, verl_ms, ours_ms))
            print(f"{label:>36} {shape.name:>10}: verl {verl_ms:8.2f} ms  ours {ours_ms:7.3f} ms  "
                  f"{verl_ms / ours_ms:5.1f}x", flush=True)
    lines = ["| configuration | batch | tokens | verl ms | ours ms | verl / ours |", "|---|---|---|---|---|---|"]
    lines += [f"| {c} | {s} | {t:,} | {v:.2f} | {o:.3f} | {v / o:.1f}x |" for c, s, t, v, o in rows]
    worst = min(v / o for *_, v, o in rows)
    target = 5.0 if cuda else 2.5
    verdicts.append(f"slowest speed-up {worst:.1f}x (target >= {target:g}x): {'PASS' if worst >= target else 'MISS'}")
    if cuda:
        slowest = max(o for *_, o in rows)
        verdicts.append(f"slowest row {slowest:.3f} ms per 1M tokens (target <= 0.3 ms): "
                        f"{'PASS' if slowest <= 0.3 else 'MISS'}; no host sync in any of ours (sync debug mode error)")
    elif not args.cpu_smoke:
        short, long_ = (make_inputs(s, device) for s in CPU_SPREAD)
        for label, cfg, _ in CONFIGS:
            s_ms, l_ms = time_interleaved([lambda c=cfg: run_ours(c, short), lambda c=cfg: run_ours(c, long_)],
                                          device, args.repeats)
            ok = 1 / 1.5 <= s_ms / l_ms <= 1.5
            verdicts.append(f"{label}: 4096 short / 256 long at {short.tokens:,} tokens: {s_ms:.1f} / {l_ms:.1f} ms "
                            f"= {s_ms / l_ms:.2f}x (target within 1.5x): {'PASS' if ok else 'MISS'}")
    table = "\n".join(lines)
    env = environment(device)
    if args.json is not None:
        import json

        args.json.write_text(json.dumps({"environment": env, "verdicts": verdicts, "rows": [
            {"configuration": c, "batch": s, "tokens": t, "verl_ms": v, "ours_ms": o, "speedup": v / o}
            for c, s, t, v, o in rows]}, indent=2))
    print("\n" + table + "\n\n" + "\n".join(verdicts) + "\n" + env)
    if args.write is not None:
        command = "python benchmarks/bench_correction.py " + " ".join(argv if argv is not None else sys.argv[1:])
        body = "\n".join([f"`{command.strip()}`: minimum of {args.repeats} interleaved rounds; {env}.", "",
                          table, "", *("- " + v for v in verdicts)])
        write_section(args.write, args.label or device.type, body)
    return 0


def write_section(path: Path, label: str, body: str) -> None:
    """Replace the block between ``<!-- bench:LABEL:start -->`` and ``<!-- bench:LABEL:end -->`` in ``path``."""
    start, end = f"<!-- bench:{label}:start -->", f"<!-- bench:{label}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Correction core vs verl 0.9.1: speed\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
