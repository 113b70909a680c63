"""Fused CPU token passes of the correction core: an optional accelerator, torch is the reference.

On the CPU the core's token work is a chain of ~25 eager torch passes over the batch. Two fused
kernels in ``token_pass.c`` replace the hot ones when the tensors live on the CPU:

* :func:`sequence_sums` — the per-sequence sums of ``slime_tis.core.ratios`` (sanitised log-ratio,
  rollout log-prob, valid and non-finite counts, veto count, and the ratio moments ``e = expm1(lc)``,
  ``e^2``, ``e - lc`` of the diagnostics) in one pass over the tokens;
* :func:`expand` — per-sequence weight and keep flag broadcast to the valid tokens.

The library is plain C (vector extensions, one thread: a second one measured no faster, the pass is
close to memory-bound; no Python or torch headers), compiled on first
use with the system C compiler (``$CC``, default ``cc``, about a second) into a cache directory and
loaded with ``ctypes``. On an accelerator, or when the library cannot be built, the torch path runs;
both are tested against each other (``tests/test_core_native.py``).

Environment:
    ``SLIME_TIS_NATIVE``: ``auto`` (default: use it if it builds, else warn once and use torch),
    ``0`` (never), ``1`` (required: raise if it cannot be built).
    ``SLIME_TIS_CACHE``: directory of the compiled library (default ``$XDG_CACHE_HOME/slime_tis`` or
    ``~/.cache/slime_tis``; if it cannot be written, a per-user directory under the system temp dir).
    The file name holds a hash of the source, compiler and flags, so nodes
    with different CPUs sharing a home directory do not share a binary built for the wrong one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["N_COLUMNS", "NativeBuildError", "available", "enabled", "sequence_sums", "expand", "library_path"]

log = logging.getLogger(__name__)

N_COLUMNS = 8  # columns of sequence_sums: slime_tis.core.ratios.ROW_*
MAX_EXTRA = 8
_SOURCE = Path(__file__).with_name("token_pass.c")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None


class NativeBuildError(RuntimeError):
    """The fused CPU kernels could not be built or loaded (only raised with ``SLIME_TIS_NATIVE=1``)."""


def _mode() -> str:
    mode = os.environ.get("SLIME_TIS_NATIVE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"SLIME_TIS_NATIVE = {mode!r}: must be 'auto', '0' or '1'")
    return mode


def _flags() -> list[str]:
    flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-Wno-psabi"]
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def _cache_dir() -> Path:
    if os.environ.get("SLIME_TIS_CACHE"):
        return Path(os.environ["SLIME_TIS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slime_tis"


def library_path() -> Path:
    """Where the library for this source, compiler and flag set lives (built or not)."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(_SOURCE.read_bytes() + repr((compiler, _flags())).encode()).hexdigest()[:16]
    return _cache_dir() / f"token_pass-{key}.so"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise NativeBuildError(f"no C compiler: CC={compiler!r} is not on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_flags(), str(_SOURCE), "-o", tmp, "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise NativeBuildError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr.strip()}")
        os.replace(tmp, target)  # atomic: concurrent ranks building the same file never see half of it
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _fallback_dir() -> Path:
    """A per-user directory under the system temp dir, for when the cache directory is not writable."""
    return Path(tempfile.gettempdir()) / f"slime_tis-{getattr(os, 'getuid', lambda: 0)()}"


def _load() -> ctypes.CDLL:
    path = library_path()
    if not path.exists():
        try:
            _build(path)
        except OSError as err:  # the cache directory cannot be created or written (a compile error is not an OSError)
            fallback = _fallback_dir() / path.name
            log.warning("slime_tis: cannot write %s (%s); building the CPU kernels in %s", path.parent, err,
                        fallback.parent)
            path = fallback
            if not path.exists():
                _build(path)
    lib = ctypes.CDLL(str(path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.slime_tis_sequence_sums.argtypes = [i64, i64, p, p, p, p, i64, p, ctypes.c_int32, ctypes.c_float,
                                            ctypes.c_float, p]
    lib.slime_tis_sequence_sums.restype = ctypes.c_int
    lib.slime_tis_expand.argtypes = [i64, i64, p, p, p, p, p, p]
    lib.slime_tis_expand.restype = None
    return lib


def _library() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; ``None`` if disabled or unavailable (``auto``)."""
    global _lib, _failed
    mode = _mode()
    if mode == "0":
        return None
    if _lib is None and (_failed is None or mode == "1"):
        with _lock:
            if _lib is None:
                try:
                    _lib = _load()
                    _failed = None
                except (OSError, subprocess.SubprocessError, NativeBuildError) as err:
                    _failed = str(err)
                    if mode == "1":
                        raise NativeBuildError(f"SLIME_TIS_NATIVE=1 but the CPU kernels are unavailable: {err}"
                                               ) from err
                    log.warning("slime_tis: fused CPU kernels unavailable, using the torch path (%s)", err)
    return _lib


def available() -> bool:
    """True if the fused CPU kernels are enabled and loaded (builds them on first call)."""
    return _library() is not None


def enabled(*tensors: Tensor) -> bool:
    """True if the fused kernels should run on ``tensors``: all on the CPU and the library is available."""
    return all(t.device.type == "cpu" for t in tensors) and _library() is not None


def _ptr(t: Tensor) -> int:
    return t.data_ptr()


def _checked(name: str, t: Tensor, numel: int, dtype: torch.dtype) -> Tensor:
    """``t`` as a contiguous CPU tensor, after checking what the C code relies on (a wrong length or
    device there would be an out-of-bounds read, not an exception)."""
    if t.device.type != "cpu" or t.dim() != 1 or t.numel() != numel or t.dtype != dtype:
        raise ValueError(f"{name} must be a 1-D {dtype} CPU tensor of {numel} elements for the fused CPU kernel, "
                         f"got {tuple(t.shape)} {t.dtype} on {t.device}")
    return t.contiguous()


def sequence_sums(
    lp_train: Tensor,
    lp_rollout: Tensor,
    valid: Tensor,
    offsets: Tensor,
    extras: tuple[Tensor, ...] = (),
    *,
    log_veto: float | None = None,
    moments_bound: float | None = None,
) -> Tensor:
    """Per-sequence sums ``[n_seq, N_COLUMNS]`` float64 (columns ``ratios.ROW_*``), one token pass.

    Args:
        lp_train, lp_rollout: ``[T]`` float32 CPU log-probs; valid: ``[T]`` bool.
        offsets: ``[n_seq + 1]`` int64 CPU ``cu_seqlens``.
        extras: ``[T]`` float32 tensors whose non-finite valid entries count as non-finite (at most 8).
        log_veto: ``log v``: count valid finite tokens with ``l < log v`` (column ``ROW_VETO``).
        moments_bound: ``B``: fill the moment columns from ``lc = clamp(l, -B, B)``.

    Per token ``l = lp_train - lp_rollout`` in float32, exactly as the torch path; the sums run in
    float32 within blocks of 512 tokens from each sequence's start and in float64 across blocks, so a
    sequence's sums do not depend on the rest of the batch.
    """
    lib = _library()
    if lib is None:
        raise NativeBuildError("the fused CPU kernels are not available")
    if len(extras) > MAX_EXTRA:
        raise ValueError(f"at most {MAX_EXTRA} extra tensors, got {len(extras)}")
    n_tokens = lp_train.numel()
    cu = _checked("offsets", offsets, max(offsets.numel(), 1), torch.int64)
    lt = _checked("lp_train", lp_train, n_tokens, torch.float32)
    lr = _checked("lp_rollout", lp_rollout, n_tokens, torch.float32)
    v = _checked("valid", valid, n_tokens, torch.bool).view(torch.uint8)
    ex = [_checked(f"extras[{i}]", e, n_tokens, torch.float32) for i, e in enumerate(extras)]
    n_seq = cu.numel() - 1
    out = torch.empty((max(n_seq, 0), N_COLUMNS), dtype=torch.float64)
    extra_ptrs = (ctypes.c_void_p * max(len(ex), 1))(*[_ptr(e) for e in ex])
    rc = lib.slime_tis_sequence_sums(
        n_seq, n_tokens, _ptr(cu), _ptr(lt), _ptr(lr), _ptr(v), len(ex), extra_ptrs,
        int(log_veto is not None), float(log_veto if log_veto is not None else 0.0),
        float(moments_bound or 0.0), _ptr(out),
    )
    if rc != 0:
        raise RuntimeError(f"slime_tis_sequence_sums failed ({rc})")
    return out


def expand(offsets: Tensor, valid: Tensor, value: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """Per-sequence ``value`` ``[n_seq]`` (float32) and ``keep`` (bool) broadcast to the valid tokens.

    Returns ``(values [T] float32, keep [T] bool)``: ``value[s]`` and ``keep[s]`` at valid tokens of
    sequence ``s``, 0 / False elsewhere.
    """
    lib = _library()
    if lib is None:
        raise NativeBuildError("the fused CPU kernels are not available")
    n_tokens, n_seq = valid.numel(), max(offsets.numel(), 1) - 1
    cu = _checked("offsets", offsets, n_seq + 1, torch.int64)
    v = _checked("valid", valid, n_tokens, torch.bool).view(torch.uint8)
    val = _checked("value", value, n_seq, torch.float32)
    kp = _checked("keep", keep, n_seq, torch.bool).view(torch.uint8)
    out_value = torch.empty(n_tokens, dtype=torch.float32)
    out_keep = torch.empty(n_tokens, dtype=torch.bool)
    lib.slime_tis_expand(n_seq, n_tokens, _ptr(cu), _ptr(v), _ptr(val), _ptr(kp), _ptr(out_value),
                         _ptr(out_keep.view(torch.uint8)))
    return out_value, out_keep
