"""Loaded by every Python process started with this folder first on ``PYTHONPATH`` (the real-tree Megatron-LM RL
test, ``tests/dist/test_megatron_rl_real_tree.py``): in a torchrun worker of that launch (``SLIME_TIS_MLM_CPU`` set,
``LOCAL_RANK`` present), the CPU stand-ins of ``tests/dist/_mlm_rl_cpu.py`` are installed before ``train_rl.py``
runs; anywhere else nothing happens."""

import os

if os.environ.get("SLIME_TIS_MLM_CPU") and os.environ.get("LOCAL_RANK") is not None:
    import _mlm_rl_cpu  # noqa: F401
