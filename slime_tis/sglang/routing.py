"""SGLang's ``routed_experts`` -> a validated ``[T, L_moe, k]`` int tensor (rollout routing replay's input).

With ``return_routed_experts`` SGLang reports, per position it ran, the ``k`` experts its router chose in each of
the model's ``L_moe`` mixture-of-experts layers: ``meta_info["routed_experts"]``, base64 of little-endian int32
values in ``[positions, L_moe, k]`` order (a nested list or an array is accepted as well). Position ``p`` of the
data is sequence position ``start_len + p`` (SGLang's ``routed_experts_start_len``: the rows of an earlier,
cached part of the sequence are not returned; 0 when absent).

:func:`parse_routed_experts` returns ``experts [num_tokens, L_moe, k]``: ``experts[s]`` = the experts the engine
routed sequence position ``s`` (input token ``s``) to, ``-1`` for positions before ``start_len``; int16 where
the expert ids fit (``num_experts <= 32767``), else int32. Refused, each with one ``ValueError`` line naming the
model's shape and the data's:

* a layer count other than the model's MoE layers, a ``k`` other than the router's top-k;
* an expert id outside ``[0, num_experts)``;
* fewer (or more) positions than ``num_tokens - start_len`` (the engine ran ``prompt + completion - 1``
  positions: the last generated token is never fed back);
* data that is not base64 of int32 values, or not an integer array.

The checks read the values (host side, once per response, at rollout time; never in the training loss).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import torch
from torch import Tensor

__all__ = ["parse_routed_experts", "routed_experts_dtype"]


def routed_experts_dtype(num_experts: int) -> torch.dtype:
    """int16 where every id in ``[-1, num_experts)`` fits, else int32."""
    return torch.int16 if num_experts <= torch.iinfo(torch.int16).max else torch.int32


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
    """``routed_experts`` of one response -> ``[num_tokens, moe_layers, topk]`` (module docstring).

    Args:
        data: ``meta_info["routed_experts"]`` (base64 of int32), or a ``[P, L_moe, k]`` list / array / tensor.
        num_tokens: the sequence positions the engine ran (``prompt_tokens + completion_tokens - 1``).
        moe_layers, topk, num_experts: the trainer's model (MoE layers, router top-k, experts per layer).
        start_len: SGLang's ``routed_experts_start_len`` (the sequence position of the data's first row).
    """
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
    out = torch.full((num_tokens, moe_layers, topk), -1, dtype=routed_experts_dtype(num_experts))
    out[start_len:] = x.to(out.dtype)
    return out
