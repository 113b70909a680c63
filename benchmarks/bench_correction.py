"""Speed of the correction core vs verl 0.9.1 on the same logical batches.

What is timed (median of ``--repeats`` runs after ``--warmup`` runs; inputs are prepared outside the
timed region, on the chosen device):

* verl: ``compute_rollout_correction_and_rejection_mask(old, rollout, mask, rollout_is="sequence",
  rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold=1.001)`` on the padded
  ``[B, L]`` batch: sequence-level truncated IS, geometric rejection in [1/1.001, 1.001], its IS and
  RS statistics and the off-policy metrics it computes internally (returned as Python floats);
* ours: ``compute_tis`` with the same configuration (``use_tis=True, mode="truncate",
  level="sequence", upper=2.0, rs_level="geometric"``) on the packed batch, full diagnostics,
  ``stats.finalize()``, and one transfer of all metric values to the host (what a logger does).

Batches (response lengths uniform in ``[L/4, L]`` unless fixed):

* ``256x2048`` and ``1024x1024``: padded shapes ``[B, L]``;
* ``4096x128 (short)`` and ``256x2048 (long)``: 4096 short vs 256 long sequences with the same
  token count (524,288, no padding), to show that our cost follows tokens, not sequences.

Targets: ours >= 5x faster than verl on every batch; ours(4096 short) / ours(256 long) within 1.5x.

Run (CPU, 2 threads)::

    .venv/bin/python benchmarks/bench_correction.py                # prints the table
    .venv/bin/python benchmarks/bench_correction.py --write docs/bench_correction.md --label cpu-ci
    .venv/bin/python benchmarks/bench_correction.py --device cuda  # GPU check
    .venv/bin/python benchmarks/bench_correction.py --profile --shapes "256x2048 (long)"
    SLIME_TIS_NATIVE=0 .venv/bin/python benchmarks/bench_correction.py   # the torch path alone

``--write FILE`` replaces only the block ``<!-- bench:LABEL:start/end -->`` of FILE (LABEL defaults
to the device type), so the hand-written analysis around it survives a re-run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "tests")]
import _verl_light  # noqa: E402,F401  (stubs ray/transformers before verl is imported)
import verl.trainer.ppo.rollout_corr_helper as rc  # noqa: E402

from slime_tis import TISConfig, compute_tis, padded_to_packed  # noqa: E402

CONFIG = TISConfig(use_tis=True, mode="truncate", level="sequence", upper=2.0, rs_level="geometric")
VERL_KWARGS = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_mean_k1",
                   rollout_rs_threshold=1.001)


@dataclass(frozen=True)
class Shape:
    """A benchmark batch: ``n_seq`` sequences padded to ``max_len``; lengths uniform in [min_len, max_len]."""

    name: str
    n_seq: int
    max_len: int
    min_len: int


SHAPES = [
    Shape("256x2048", 256, 2048, 512),
    Shape("1024x1024", 1024, 1024, 256),
    Shape("4096x128 (short)", 4096, 128, 128),
    Shape("256x2048 (long)", 256, 2048, 2048),
]


@dataclass
class Inputs:
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # lp_old, lp_rollout, mask (float) [B, L]
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # lp_old, lp_rollout, mask, cu
    tokens: int


def make_inputs(shape: Shape, device: torch.device, seed: int = 0) -> Inputs:
    """Random log-probs with a small train/rollout mismatch (per-token sd 0.02, per-sequence drift)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shape.min_len, shape.max_len + 1, (shape.n_seq,), generator=g)
    mask = (torch.arange(shape.max_len)[None, :] < lengths[:, None]).float()
    lp_rollout = -6.0 * torch.rand(shape.n_seq, shape.max_len, generator=g) ** 2
    drift = 1e-3 * torch.randn(shape.n_seq, 1, generator=g)
    lp_old = lp_rollout + drift + 0.02 * torch.randn(shape.n_seq, shape.max_len, generator=g)
    p_old, cu = padded_to_packed(lp_old, mask)
    p_rollout, _ = padded_to_packed(lp_rollout, mask)
    p_mask = padded_to_packed(mask, mask)[0] != 0
    to = lambda *ts: tuple(t.to(device).contiguous() for t in ts)  # noqa: E731
    return Inputs(to(lp_old, lp_rollout, mask), to(p_old, p_rollout, p_mask, cu), int(lengths.sum()))


def run_verl(inputs: Inputs) -> dict[str, float]:
    old, rollout, mask = inputs.padded
    _, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **VERL_KWARGS)
    return metrics  # Python floats: verl syncs on every .item()


def run_ours(inputs: Inputs) -> list[float]:
    old, rollout, mask, cu = inputs.packed
    res = compute_tis(CONFIG, old, rollout, mask, cu)
    metrics = res.stats.finalize()
    return torch.stack(list(metrics.values())).tolist()  # host-sync-ok: the logger's single read


def time_interleaved(
    fns: list[Callable[[], object]], device: torch.device, warmup: int, repeats: int
) -> list[float]:
    """Median wall time (ms) of each function; the functions alternate within every repeat, so a
    change in machine load (a shared CI box) hits all of them alike. Synchronised on CUDA."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for fn in fns:
            fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, acc in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            acc.append((time.perf_counter() - start) * 1e3)
    return [statistics.median(t) for t in times]


def check_agreement(inputs: Inputs) -> None:
    """Sanity: both sides reject the same tokens and report the same KL (else the timing is moot)."""
    old, rollout, mask = inputs.padded
    _, new_mask, metrics = rc.compute_rollout_correction_and_rejection_mask(old, rollout, mask, **VERL_KWARGS)
    res = compute_tis(CONFIG, *inputs.packed)
    verl_keep = padded_to_packed(new_mask, mask)[0] != 0
    agree = float((verl_keep == res.keep_mask).float().mean())  # host-sync-ok (benchmark check)
    kl = float(res.stats.finalize()["tis/kl"])  # host-sync-ok
    if agree < 0.999 or abs(kl - metrics["rollout_corr/kl"]) > 1e-4 * max(abs(kl), 1e-6):
        verl_kl = metrics["rollout_corr/kl"]
        raise SystemExit(f"outputs disagree: keep-mask agreement {agree:.5f}, kl {kl} vs verl {verl_kl}")


def environment(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {cpu}"
    try:
        rev = subprocess.run(["git", "-C", str(_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return (f"{where}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{os.cpu_count()} cores visible; python {platform.python_version()}"
            + (f"; slime_tis at {rev}" if rev else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch CPU threads (default min(2, cores))")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement (median kept)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first (default 2)")
    parser.add_argument("--shapes", nargs="*", default=None,
                        help="subset of shape names (default all): " + ", ".join(s.name for s in SHAPES))
    parser.add_argument("--write", type=Path, default=None, help="also write the markdown table to this file")
    parser.add_argument("--label", default=None,
                        help="name of the block that --write replaces (default: the device type)")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler op tables of both sides on the first shape instead")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    shapes = [s for s in SHAPES if args.shapes is None or s.name in args.shapes]
    if args.profile:
        profile(shapes[0], device)
        return 0

    rows = []
    all_inputs = {}
    for shape in shapes:
        inputs = all_inputs[shape.name] = make_inputs(shape, device)
        check_agreement(inputs)
        verl_ms, ours_ms = time_interleaved(
            [lambda i=inputs: run_verl(i), lambda i=inputs: run_ours(i)], device, args.warmup, args.repeats
        )
        rows.append((shape, inputs.tokens, verl_ms, ours_ms))
        print(f"{shape.name:>18}: {inputs.tokens:>8} tokens  verl {verl_ms:9.2f} ms  ours {ours_ms:8.2f} ms  "
              f"ratio {verl_ms / ours_ms:6.1f}x", flush=True)
    header = ["config", "sequences", "tokens", "verl ms", "ours ms", "ratio (verl / ours)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for shape, tokens, verl_ms, ours_ms in rows:
        lines.append(f"| {shape.name} | {shape.n_seq} | {tokens:,} | {verl_ms:.1f} | {ours_ms:.1f} | "
                     f"{verl_ms / ours_ms:.1f}x |")
    verdicts = []
    worst = min(v / o for _, _, v, o in rows)
    verdicts.append(f"slowest speed-up {worst:.1f}x (target >= 5x): {'PASS' if worst >= 5 else 'MISS'}")
    if "4096x128 (short)" in all_inputs and "256x2048 (long)" in all_inputs:
        # ours on short and long batches timed against each other in one interleaved loop (the rows above
        # are timed one after the other, so load drift on a shared box would enter their ratio)
        short, long_ = all_inputs["4096x128 (short)"], all_inputs["256x2048 (long)"]
        short_ms, long_ms = time_interleaved([lambda: run_ours(short), lambda: run_ours(long_)], device,
                                             args.warmup, args.repeats)
        spread = short_ms / long_ms
        verdicts.append(f"ours 4096 short / 256 long at equal tokens, timed interleaved: {short_ms:.1f} / "
                        f"{long_ms:.1f} ms = {spread:.2f}x (target within 1.5x): "
                        f"{'PASS' if 1 / 1.5 <= spread <= 1.5 else 'MISS'}")
    table = "\n".join(lines)
    env = environment(device)
    print()
    print(table)
    print("\n".join(verdicts))
    print(env)

    if args.write is not None:
        flags = " ".join(argv if argv is not None else sys.argv[1:])
        prefix = f"SLIME_TIS_NATIVE={os.environ['SLIME_TIS_NATIVE']} " if "SLIME_TIS_NATIVE" in os.environ else ""
        command = f"{prefix}python benchmarks/bench_correction.py {flags}".strip()
        body = render_markdown(table, verdicts, env, command, args)
        write_section(args.write, args.label or device.type, body)
        print(f"wrote {args.write}")
    return 0


def write_section(path: Path, label: str, body: str) -> None:
    """Replace the measured block ``label`` in ``path`` (between ``<!-- bench:<label>:start/end -->``
    markers), keeping the rest of the file (the hand-written analysis); create the file if needed."""
    start, end = f"<!-- bench:{label}:start -->", f"<!-- bench:{label}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Correction core vs verl 0.9.1: speed\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def profile(shape: Shape, device: torch.device, rows: int = 25) -> None:
    """Print where the time goes (self time per op) for one call of each side."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    inputs = make_inputs(shape, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    for name, fn in (("ours", run_ours), ("verl", run_verl)):
        for _ in range(2):
            fn(inputs)
        with torch_profile(activities=activities) as prof:
            fn(inputs)
        print(f"== {name}: {shape.name}, {inputs.tokens} tokens, {environment(device)}")
        print(prof.key_averages().table(sort_by=sort, row_limit=rows))


def render_markdown(table: str, verdicts: list[str], env: str, command: str, args: argparse.Namespace) -> str:
    """The measured block: command, machine, table and verdicts."""
    lines = [
        f"`{command}`: median of {args.repeats} runs after {args.warmup} warm-up runs, both sides",
        f"interleaved; {env}.",
        "",
        table,
        "",
        *("- " + v for v in verdicts),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
