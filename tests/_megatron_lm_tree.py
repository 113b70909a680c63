"""Where the tests find NVIDIA/Megatron-LM's source at commit d98e8a64dd (``megatron.training``, ``megatron.rl`` and
``train_rl.py``, which no megatron-core wheel ships): a ``.tar.gz`` of the tree with ``train_rl.py`` at its top, named
by ``MEGATRON_LM_TARBALL`` (make one with ``git -C Megatron-LM archive --format=tar.gz -o mlm.tar.gz d98e8a64dd``),
else the copy CI keeps beside the clone. Tests that need it skip, saying so, where neither exists."""

from __future__ import annotations

import os
from pathlib import Path

_CI_COPY = Path(__file__).resolve().parents[2] / "shared" / "third_party" / "megatron-lm-d98e8a64dd.tar.gz"
TARBALL = Path(os.environ.get("MEGATRON_LM_TARBALL", _CI_COPY))
MISSING = (f"Megatron-LM d98e8a64dd's tree is not here ({TARBALL} absent): set MEGATRON_LM_TARBALL to a tar.gz of it "
           "(tests/_megatron_lm_tree.py)")
