"""Run a kernel test module again in a child pytest with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter).

The variable must be set before triton is first imported, which the parent process may already have done
during collection; a child process is the one reliable way. The child's kernel cases must all pass, with a
fallback to the torch code (``KernelFallbackWarning``) an error: the kernels really run. Also here:
:func:`gpu_max_semantics`, the GPU's NaN-dropping max and min for the interpreter.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def assert_module_passes_under_interpreter(module_file: str, min_passed: int) -> None:
    """Fail unless ``pytest module_file`` under the interpreter exits 0 with at least ``min_passed`` passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
           "-W", "error::slime_tis.kernels.dispatch.KernelFallbackWarning", str(module_file)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, log


@contextlib.contextmanager
def gpu_max_semantics(enabled: bool = True) -> Iterator[None]:
    """Make the interpreter's elementwise float max/min behave as compiled CUDA code does.

    ``tl.maximum`` / ``tl.minimum`` (default ``propagate_nan``) lower to PTX ``max.f32`` / ``min.f32``, which
    return the non-NaN operand (``fmax``); the interpreter computes them with ``np.maximum`` / ``np.minimum``,
    which return NaN. Inside this context the interpreter uses ``np.fmax`` / ``np.fmin`` instead, so a kernel
    that loses a NaN on the GPU loses it here too. (Reductions already match: the interpreter's ``tl.max`` /
    ``tl.min`` are ``np.nanmax`` / ``np.nanmin``.) ``tests/test_kernels_logprobs.py`` checks the premise on
    the sm_90 PTX. Only meaningful with ``TRITON_INTERPRET=1``.
    """
    if not enabled:
        yield
        return
    import numpy as np
    from triton.runtime.interpreter import InterpreterBuilder

    saved = InterpreterBuilder.create_maxnumf, InterpreterBuilder.create_minnumf
    InterpreterBuilder.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
    InterpreterBuilder.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
    try:
        yield
    finally:
        InterpreterBuilder.create_maxnumf, InterpreterBuilder.create_minnumf = saved


def reset_dispatch() -> None:
    """Forget every kernel fallback and warning of this process (``slime_tis.kernels.dispatch``)."""
    from slime_tis.kernels import dispatch

    dispatch._disabled.clear()
    dispatch._warned.clear()
