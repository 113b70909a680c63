"""SGLang's ``routed_experts`` -> a validated ``[T, L_moe, k]`` int tensor (rollout routing replay's input).

The data (base64 of little-endian int32 ``[positions, L_moe, k]``; a nested list or an array too) starts at sequence
position ``start_len``. ``experts[s]`` = the experts the engine routed position ``s`` to, ``-1`` before
``start_len``; int16 where ids fit (``num_experts <= 32767``), else int32. Refused, one ``ValueError`` line naming
the model's shape and the data's: another layer count or ``k``, an id outside ``[0, num_experts)``, another number
of positions than ``num_tokens - start_len``, data that is not base64 of int32 or an integer array. Host side, once
per response at rollout time.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch
from torch import Tensor

__all__ = ["parse_routed_experts"]


def _as_tensor(data: Any, moe_layers: int, topk: int) -> Tensor:
    model = f"the model's [tokens, moe_layers={moe_layers}, topk={topk}]"
    if isinstance(data, str):
        try:
            raw = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"routed_experts is not base64 (SGLang's int32 wire format): {e}") from None
        per_pos = 4 * moe_layers * topk
        if len(raw) % per_pos:
            raise ValueError(f"routed_experts has {len(raw)} bytes, not a multiple of 4 x moe_layers ({moe_layers}) "
                             f"x topk ({topk}) = {per_pos}: its shape does not match {model}")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.int32) if raw else torch.zeros(0, dtype=torch.int32)
        return flat.view(-1, moe_layers, topk)
    try:
        x = torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"routed_experts must be base64, a nested list or an integer array, got "
                         f"{type(data).__name__}: {e}") from None
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise ValueError(f"routed_experts must hold integer expert ids, got dtype {x.dtype}")
    if x.dim() != 3 or tuple(x.shape[1:]) != (moe_layers, topk):
        raise ValueError(f"routed_experts has shape {list(x.shape)}, not {model}")
    return x


def parse_routed_experts(data: Any, *, num_tokens: int, moe_layers: int, topk: int, num_experts: int,
                         start_len: int = 0) -> Tensor:
    """``meta_info["routed_experts"]`` (base64 of int32, or a ``[P, L_moe, k]`` list / array) -> ``experts
    [num_tokens, moe_layers, topk]`` (module docstring); ``num_tokens``: the positions the engine ran (``prompt +
    completion - 1``), ``start_len``: SGLang's ``routed_experts_start_len``."""
    for name, v, lo in (("num_tokens", num_tokens, 0), ("moe_layers", moe_layers, 1), ("topk", topk, 1),
                        ("num_experts", num_experts, 1), ("start_len", start_len, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"parse_routed_experts: {name} must be an int >= {lo}, got {v!r}")
    if topk > num_experts:
        raise ValueError(f"parse_routed_experts: topk={topk} exceeds num_experts={num_experts}")
    x = _as_tensor(data, moe_layers, topk)
    want = num_tokens - start_len
    if x.shape[0] != want:
        few = "fewer" if x.shape[0] < want else "more"
        raise ValueError(f"routed_experts covers {x.shape[0]} positions from routed_experts_start_len={start_len}, "
                         f"{few} than the {want} of the sequence's {num_tokens} routed tokens (shape "
                         f"{list(x.shape)} vs [{want}, {moe_layers}, {topk}])")
    if x.numel():
        lo_id, hi_id = int(x.min()), int(x.max())  # host-sync-ok (rollout side, once per response)
        if lo_id < 0 or hi_id >= num_experts:
            bad = lo_id if lo_id < 0 else hi_id
            raise ValueError(f"routed_experts has expert id {bad} outside [0, num_experts={num_experts})")
    dtype = torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32
    out = torch.full((num_tokens, moe_layers, topk), -1, dtype=dtype)
    out[start_len:] = x.to(out.dtype)
    return out
