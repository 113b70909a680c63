"""Offline tools: log-prob dumps (write, read, slime's own debug dumps), ``slime-tis diagnose`` and its console
script. Nothing here runs inside a training step except :func:`slime_tis.tools.dump.write_logprob_dump`, which the
adapters call on dump steps."""
