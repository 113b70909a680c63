"""Test-only helpers: megatron-core on a CPU-only torch build with gloo (never imported by slime_tis)."""
