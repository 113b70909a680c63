"""The host-neutral layer every host translates into: the parallel layer (``reduce``, ``agreement``,
``logprobs``, ``parallel``), the log-prob settings (``settings``) and the step engine (``step``)."""
