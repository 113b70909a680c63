"""Megatron-LM's own RL loop (``train_rl.py``) as a host: ``torchrun ... -m slime_tis.megatron_rl train_rl.py <flags>``
(docs/megatron_rl.md). ``host.py``: micro-batches -> ``TISBatch`` and the ``forward_step``; ``flags.py``: one
configuration from both flag sets; ``rollout.py``: the update preparation; ``__main__.py``: the launcher.
"""

from slime_tis.megatron_rl.host import RLHost, add_megatron_rl_tis_arguments, config_from_megatron_rl_args

__all__ = ["RLHost", "add_megatron_rl_tis_arguments", "config_from_megatron_rl_args"]
