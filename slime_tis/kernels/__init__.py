"""Triton kernels beside the torch code they must equal (docs/kernels.md); they take their process group as an
argument. Modules that import triton at their top (``logprobs``, ``correction``, ``_output_layer_triton``) are
reached only through :mod:`slime_tis.kernels.dispatch`; the correction core imports no kernel."""
