"""Ahead-of-time CUDA builds of the fused output layer's Triton kernels, for the tests (no GPU needed)."""

from __future__ import annotations

import torch
import triton

from slime_tis.kernels._output_layer_triton import (
    CUDA_BLOCKS,
    CUDA_LAUNCH,
    _dhidden_kernel,
    _dlogits_kernel,
    _stats_kernel,
)


def compile_for_cuda(dtype: torch.dtype, hidden_size: int, vocab_shard: int, chunk: int, arch: int = 90) -> dict:
    """Compile both kernels ahead of time for ``sm_<arch>`` with the CUDA launch configuration; no GPU needed.

    Catches what the interpreter does not check (non-constexpr globals, type unification in ``if``, layout
    and shared-memory limits) down to the cubin. Pointers and strides carry the 16-divisibility a real
    launch specialises on (tensors from the caching allocator, ``H % 16 == 0``), so the build is the one a
    GPU would run. Returns ``{kernel name: compiled kernel}`` for ``stats``, ``dlogits``, ``dhidden``
    (``.asm["ptx"|"ttgir"|"cubin"]``, ``.metadata``).
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    probe = torch.empty(0, dtype=dtype, device="meta")
    bt, bv, bh = CUDA_BLOCKS
    precision = "ieee" if dtype == torch.float32 else "tf32"
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}[probe.dtype]
    common = {"h_ptr": ptr, "w_ptr": ptr, "y_ptr": "*i64", "rows_ptr": "*i64", "n_active_ptr": "*i32"}
    blocks = {"BT": bt, "BV": bv, "BH": bh, "PRECISION": precision, "Vp": vocab_shard, "H": hidden_size}
    sigs = {
        "stats": (_stats_kernel, {**common, "out_ptr": "*fp32", "T": "i32", "vocab_start": "i32",
                                  "temperature": "fp32", "stride_h": "i32", "stride_w": "i32",
                                  "tiles_per_split": "i32"}, blocks),
        "dlogits": (_dlogits_kernel, {**common, "log_z_ptr": "*fp32", "ent_ptr": "*fp32", "g_lp_ptr": "*fp32",
                                      "g_h_ptr": "*fp32", "d_ptr": ptr, "T": "i32", "col_start": "i32",
                                      "vocab_start": "i32", "temperature": "fp32", "stride_h": "i32",
                                      "stride_w": "i32", "stride_d": "i32"}, {**blocks, "chunk_cols": chunk}),
        # the last chunk's variant (accumulate, store in the hidden dtype): the widest register use
        "dhidden": (_dhidden_kernel, {"d_ptr": ptr, "w_ptr": ptr, "acc_ptr": "*fp32", "out_ptr": ptr,
                                      "rows_ptr": "*i64", "n_active_ptr": "*i32", "T": "i32", "stride_d": "i32",
                                      "stride_w": "i32", "stride_acc": "i32", "stride_out": "i32"},
                    {"C": chunk, "H": hidden_size, "ACCUMULATE": True, "STORE_INACTIVE": True, "BT": bt, "BH": bv,
                     "BC": bh, "PRECISION": precision}),
    }
    out = {}
    for name, (fn, sig, const) in sigs.items():
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(sig)
                 if sig[arg].startswith("*") or arg.startswith("stride")}
        sig = {**sig, **{k: "constexpr" for k in const}}
        out[name] = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                   target=GPUTarget("cuda", arch, 32), options=CUDA_LAUNCH)
    return out
