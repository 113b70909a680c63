"""Megatron-LM's own RL loop (``train_rl.py`` with ``megatron/rl/``) as a host of the rollout correction.

Launch: the user's ``train_rl.py`` command with one word more (``docs/megatron_rl.md``)::

    torchrun ... -m slime_tis.megatron_rl train_rl.py <Megatron-LM flags> <slime_tis flags>

``host.py`` translates Megatron-LM's RL micro-batches (unpacked 7-tuples or sequence-packed bins) into the step
engine's ``TISBatch`` and is the ``forward_step`` the launcher (``__main__.py``) hands to ``pretrain`` in place of
``train_rl.forward_step``; ``flags.py`` maps Megatron-LM's flags and the plugin's onto one configuration;
``rollout.py`` wraps Megatron-LM's update
preparation (the host's pi_old / pi_ref passes, the rollout collection handed to the host).
"""

from slime_tis.megatron_rl.host import RLHost, add_megatron_rl_tis_arguments, config_from_megatron_rl_args

__all__ = ["RLHost", "add_megatron_rl_tis_arguments", "config_from_megatron_rl_args"]
