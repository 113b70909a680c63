"""GPU kernels (Triton) beside the torch reference they must equal.

Each submodule imports triton at its top, so import a submodule only where triton is installed; the
callers (e.g. :mod:`slime_tis.megatron.logprobs`) import them lazily and fall back to the torch path.
CI runs the kernels on CPU under ``TRITON_INTERPRET=1``. ``output_layer`` (the fused output layer) is
the exception: it holds the torch reference itself and imports its kernels (``_output_layer_triton``) only
on the Triton path, so it imports without triton.
"""
