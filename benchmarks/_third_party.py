"""What the GPU acceptance run compares with: the carried wheels, their check, and the libraries' entry points.

The GPU image has Python 3.12, torch 2.11 and Triton 3.6 and no network; everything else travels as wheels in
``.whl/`` (git-ignored), built here by ``bash benchmarks/gpu_wheels.sh``:

    python3 benchmarks/_third_party.py --requirements        # the pinned set, one ``name==version`` a line
    python3 benchmarks/_third_party.py --check-wheels .whl   # the folder holds exactly that set, < 64 MiB
    python benchmarks/_third_party.py --check-imports        # every library imports (exit 3 naming what does not)

verl is installed without its dependencies; ``ray``, ``transformers`` and ``orjson`` are stubbed on import
(``tests/_verl_light.py``; verl touches them only for type hints, decorators and classes its kernel and its
correction helper never call; the image's transformers is newer than verl 0.9.1 accepts), and the pure-Python
packages its correction helper runs or imports travel with it: ``tensordict`` (with ``pyvers``), ``omegaconf``
and ``codetiming``.

Entry points, each ``f(...) -> (log_prob [T] float32 or None, entropy [T] or None, loss scalar)``:

* logits ``[T, V]`` in (``LOGITS``): ``plain`` (``torch.log_softmax(z.float() / tau).gather``, entropy from the
  same probabilities: what every user has), ``verl`` (``verl.utils.torch_functional.logprobs_from_logits`` and
  ``entropy_from_logits`` of ``z / tau``; without flash-attn, as in the image, its row-wise torch path), ``liger``
  (``LigerCrossEntropyLoss``: cross-entropy only, no entropy, no temperature);
* hidden ``[T, H]`` and weight ``[V, H]`` in (``HIDDEN``): ``verl_fused`` (``verl.utils.kernel.
  linear_cross_entropy``: log-prob and entropy with temperature), ``liger`` (``LigerFusedLinearCrossEntropyLoss``)
  and ``cce`` (``cut_cross_entropy.linear_cross_entropy``), both cross-entropy only.

Cut Cross-Entropy and verl's fused kernel take hidden states, never logits: their logits-table rows say so.
With ``stand_in=True`` (the CPU smoke run) a library that is missing or cannot run on CPU is replaced by the same
loss in plain torch, and the row's note says so; on CUDA a missing library is an error.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# distribution, version, module that must import, pure wheel (py3-none-any)
CARRIED: tuple[tuple[str, str, str, bool], ...] = (
    ("megatron-core", "0.16.1", "megatron.core", False),
    ("liger-kernel", "0.8.5", "liger_kernel.transformers", True),
    ("cut-cross-entropy", "25.1.1", "cut_cross_entropy", True),
    ("verl", "0.9.1", "verl.utils.kernel.linear_cross_entropy", True),
    ("tensordict", "0.15.3", "tensordict", True),
    ("pyvers", "0.2.3", "pyvers", True),
    ("omegaconf", "2.4.0", "omegaconf", True),
    ("codetiming", "1.4.0", "codetiming", True),
)
IMAGE = {"torch": "2.11.0", "triton": "3.6.0", "python": "3.12"}  # what the GPU image has
WHEELS_MIB_LIMIT = 64
HIDDEN_ONLY = "n/a: takes hidden states and a weight, not logits (see the output-layer table)"


# ------------------------------------------------------------------------------------------------ wheels
def _dist_of(wheel: Path) -> tuple[str, str]:
    name, version = wheel.name.split("-")[:2]
    return name.lower().replace("_", "-"), version


def check_wheels(folder: Path) -> list[str]:
    """Problems of the wheel folder: the set differs from ``CARRIED``, a wheel that must be pure is not, a
    requirement on torch / triton the image does not meet, or the folder is over the size limit."""
    from packaging.requirements import Requirement

    problems = []
    wheels = sorted(folder.glob("*.whl"))
    found = {_dist_of(w)[0]: w for w in wheels}
    for dist, version, _, pure in CARRIED:
        w = found.pop(dist, None)
        if w is None:
            problems.append(f"missing: {dist}=={version}")
            continue
        if _dist_of(w)[1] != version:
            problems.append(f"{w.name}: version {_dist_of(w)[1]}, want {version}")
        tags = w.name[:-4].split("-")[-3:]
        if pure and tags != ["py3", "none", "any"]:
            problems.append(f"{w.name}: not a pure wheel ({'-'.join(tags)})")
        if not pure and not (tags[0] == "cp312" and "x86_64" in tags[2]):
            problems.append(f"{w.name}: not a CPython 3.12 x86_64 wheel ({'-'.join(tags)})")
        with zipfile.ZipFile(w) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                req = Requirement(line.split(":", 1)[1].strip())
                if req.name in ("torch", "triton") and not (req.marker and "extra" in str(req.marker)):
                    if not req.specifier.contains(IMAGE[req.name], prereleases=True):
                        problems.append(f"{w.name}: requires {req}, the image has {req.name} {IMAGE[req.name]}")
    problems += [f"unexpected wheel (not in the carried set): {w.name}" for w in found.values()]
    mib = sum(w.stat().st_size for w in wheels) / 2**20
    if mib >= WHEELS_MIB_LIMIT:
        problems.append(f"{folder} is {mib:.1f} MiB, over {WHEELS_MIB_LIMIT} MiB")
    return problems


def install_verl_shim() -> None:
    """Stub the packages verl imports but its kernel and correction helper never use (before ``import verl``)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.append(str(ROOT / "tests"))
    import _verl_light  # noqa: F401


def check_imports() -> dict[str, str]:
    """module -> version, or ``"MISSING: <error>"``."""
    install_verl_shim()
    out = {}
    for dist, _, module, _ in CARRIED:
        try:
            importlib.import_module(module)
            out[module] = _version(dist)
        except Exception as exc:  # noqa: BLE001 -- any import failure is reported by name
            out[module] = f"MISSING: {type(exc).__name__}: {exc}"[:300]
    try:
        importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
        out["verl.trainer.ppo.rollout_corr_helper"] = _version("verl")
    except Exception as exc:  # noqa: BLE001
        out["verl.trainer.ppo.rollout_corr_helper"] = f"MISSING: {type(exc).__name__}: {exc}"[:300]
    return out


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "?"


# ------------------------------------------------------------------------------------------------ entry points
def _plain_logits(torch, z, y, tau):
    lsm = torch.log_softmax(z.float() / tau, dim=-1)
    return lsm.gather(-1, y[:, None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)


def _verl_logits(torch, z, y, tau):
    install_verl_shim()
    import verl.utils.torch_functional as verl_f

    x = z / tau
    return verl_f.logprobs_from_logits(x, y).float(), verl_f.entropy_from_logits(x).float()


def _liger_logits(torch, z, y, tau):
    from liger_kernel.transformers import LigerCrossEntropyLoss

    return None, None, LigerCrossEntropyLoss(reduction="sum")(z, y)


def _verl_fused(torch, h, w, y, tau):
    install_verl_shim()
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(h, w, y, float(tau), "none")


def _liger_fused(torch, h, w, y, tau):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    return None, None, LigerFusedLinearCrossEntropyLoss(reduction="sum")(w, h, y)


def _cce(torch, h, w, y, tau):
    from cut_cross_entropy import linear_cross_entropy

    return None, None, linear_cross_entropy(h, w, y, reduction="sum")


def _stand_in_ce(torch, z, y):
    """Summed cross-entropy in plain torch (ignore_index -100): the stand-in for a CE-only library."""
    return None, None, torch.nn.functional.cross_entropy(z.float(), y, ignore_index=-100, reduction="sum")


LOGITS: dict[str, tuple[str, Callable | None]] = {  # name -> (what it computes, entry point)
    "plain": ("log-prob + entropy", _plain_logits),
    "verl": ("log-prob + entropy", _verl_logits),
    "liger": ("cross-entropy only, no temperature", _liger_logits),
    "verl_fused": (HIDDEN_ONLY, None),
    "cce": (HIDDEN_ONLY, None),
}
HIDDEN: dict[str, tuple[str, Callable]] = {
    "verl_fused": ("log-prob + entropy", _verl_fused),
    "liger": ("cross-entropy only", _liger_fused),
    "cce": ("cross-entropy only", _cce),
}


def logits_method(torch, name: str, stand_in: bool) -> tuple[Callable | None, str]:
    """``(f(z, y, tau) -> (lp, H) or (None, None, loss), note)``; ``f`` is None for a hidden-only library."""
    what, fn = LOGITS[name]
    if fn is None:
        return None, what
    probe = _probe(torch, lambda: fn(torch, *_tiny_logits(torch), 0.7), name, stand_in)
    if probe:
        return (lambda z, y, tau: _stand_in_ce(torch, z, y)) if "liger" in name else (
            lambda z, y, tau: _plain_logits(torch, z, y, tau)), probe
    return (lambda z, y, tau: fn(torch, z, y, tau)), what


def hidden_method(torch, name: str, stand_in: bool) -> tuple[Callable, str]:
    """``(f(h, w, y, tau) -> (lp, H) or (None, None, loss), note)``."""
    what, fn = HIDDEN[name]
    probe = _probe(torch, lambda: fn(torch, *_tiny_hidden(torch), 0.7), name, stand_in)
    if probe:
        if name == "verl_fused":
            return (lambda h, w, y, tau: _plain_logits(torch, h @ w.t(), y, tau)), probe
        return (lambda h, w, y, tau: _stand_in_ce(torch, h @ w.t(), y)), probe
    return (lambda h, w, y, tau: fn(torch, h, w, y, tau)), what


def _tiny_logits(torch):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 16, generator=g).to(torch.bfloat16), torch.randint(0, 16, (4,), generator=g)


def _tiny_hidden(torch):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 8, generator=g).to(torch.bfloat16)
    return h, torch.randn(16, 8, generator=g).to(torch.bfloat16), torch.randint(0, 16, (4,), generator=g)


def _probe(torch, call, name: str, stand_in: bool) -> str:
    """'' when the library runs here (always on CUDA: the tensors of the real call decide), else the stand-in's
    note (CPU smoke run only; a missing library on CUDA raises)."""
    if torch.cuda.is_available() and not stand_in:
        return ""
    try:
        call()
        return ""
    except Exception as exc:  # noqa: BLE001 -- missing, or needs CUDA: the smoke run's stand-in
        if not stand_in:
            raise
        return f"CPU stand-in (plain torch, same loss): {name} cannot run here ({type(exc).__name__})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requirements", action="store_true", help="print the carried set, name==version a line")
    p.add_argument("--check-wheels", type=Path, metavar="DIR", help="check the wheel folder; exit 1 on a problem")
    p.add_argument("--check-imports", action="store_true", help="import every carried library; exit 3 if one fails")
    p.add_argument("--stand-ins-ok", action="store_true",
                   help="with --check-imports: report a missing library (the CPU smoke run's stand-in), exit 0")
    p.add_argument("--json", type=Path, default=None, help="with --check-imports: write module -> version here")
    args = p.parse_args(argv)
    if args.requirements:
        print("\n".join(f"{d}=={v}" for d, v, _, _ in CARRIED))
    if args.check_wheels is not None:
        problems = check_wheels(args.check_wheels)
        mib = sum(w.stat().st_size for w in args.check_wheels.glob("*.whl")) / 2**20
        for line in problems:
            print(f"wheel check: {line}", file=sys.stderr)
        print(f"{args.check_wheels}: {len(list(args.check_wheels.glob('*.whl')))} wheels, {mib:.1f} MiB, "
              f"{'OK' if not problems else 'PROBLEMS'} (image: python {IMAGE['python']}, torch {IMAGE['torch']}, "
              f"triton {IMAGE['triton']})")
        if problems:
            return 1
    if args.check_imports:
        os.environ.setdefault("VERL_LIGHT_FORCE", "1")
        res = check_imports()
        for module, ver in res.items():
            print(f"{module}: {ver}")
        missing = [m for m, v in res.items() if v.startswith("MISSING")]
        if args.json is not None:
            import json

            args.json.write_text(json.dumps({"modules": res, "missing": missing,
                                             "stand_ins": missing if args.stand_ins_ok else []}, indent=2))
        if missing and args.stand_ins_ok:
            print(f"missing here (CPU stand-ins in the benchmarks): {', '.join(missing)}")
        elif missing:
            print(f"CARRIED SET INCOMPLETE: {', '.join(missing)} (build .whl/ with bash benchmarks/gpu_wheels.sh "
                  "and name .whl in the device call's carry)", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
