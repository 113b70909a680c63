"""GPU kernels (Triton) beside the torch reference they must equal; they take their process group as an argument
and never import the Megatron adapter.

``logprobs`` and ``correction`` import triton at their top, so import them only where triton is installed; the
callers (e.g. :mod:`slime_tis.engine.logprobs`) reach them through :mod:`slime_tis.kernels.dispatch` (the
``kernels="torch"|"triton"`` switch) and fall back to the torch path; the correction core imports no kernel and
receives its token pass from the configuration (``token_pass``, ``Plan.token_pass``). ``output_layer`` holds its
torch reference itself and imports its kernels (``_output_layer_triton``) only on the Triton path;
``logprobs_torch`` (the torch backward of the log-prob kernel), ``matmul``, ``dispatch`` and ``token_pass`` need no
triton. CI runs the kernels on CPU under
``TRITON_INTERPRET=1``.
"""
