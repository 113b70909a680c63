"""Run a kernel test module again in a child pytest with ``TRITON_INTERPRET=1`` (Triton's CPU interpreter).

The variable must be set before triton is first imported, which the parent process may already have done
during collection; a child process is the one reliable way. The child's kernel cases must all pass.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def assert_module_passes_under_interpreter(module_file: str, min_passed: int) -> None:
    """Fail unless ``pytest module_file`` under the interpreter exits 0 with at least ``min_passed`` passes."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", str(module_file)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    log = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, log
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) >= min_passed, log
