"""The test suite's one import set-up.

Every test module imports the repository root (``slime_tis``, ``examples``, ``patches``) and ``tests/`` (helper
modules such as ``_cpu``, ``_verl_light``; a package named ``tests`` would be shadowed by verl's) without a path
line of its own; pytest adds a test module's own folder (``tests/dist`` for the torchrun tests). The same folders
go onto ``PYTHONPATH`` for the processes the tests start (torchrun workers, the example job, interpreter runs),
whose scripts then import them as the tests do.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
_PATHS = [str(ROOT), str(TESTS), str(TESTS / "dist")]

for _p in reversed(_PATHS):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ["PYTHONPATH"] = os.pathsep.join(_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                                       if p and p not in _PATHS])


@pytest.fixture(autouse=True)
def _fresh_slime_hook_state():
    """slime's hooks keep process-wide state between calls (slime loads them by path): each test starts without
    what an earlier test in the same worker process left there."""
    yield
    slime = sys.modules.get("slime_tis.slime")
    if slime is not None:
        slime.STATE.clear()
