"""SGLang's ``routed_experts`` -> ``[T, L_moe, k]`` (``slime_tis.sglang.parse_routed_experts``): the wire format
(base64 of int32), ``routed_experts_start_len``, and every refusal as one line naming both shapes."""

from __future__ import annotations

import base64

import pytest
import torch

from slime_tis.sglang import parse_routed_experts


def wire(x: torch.Tensor) -> str:
    return base64.b64encode(x.to(torch.int32).numpy().tobytes()).decode()


X = torch.tensor([[[0, 3], [1, 2]], [[2, 1], [3, 0]], [[1, 0], [0, 1]]])  # [3 positions, 2 MoE layers, k=2]
SHAPE = dict(moe_layers=2, topk=2, num_experts=4)


def test_wire_list_and_tensor_inputs_agree_and_start_len_pads_with_minus_one():
    out = parse_routed_experts(wire(X), num_tokens=3, **SHAPE)
    assert out.dtype == torch.int16 and torch.equal(out.long(), X)
    assert torch.equal(parse_routed_experts(X.tolist(), num_tokens=3, **SHAPE), out)
    assert torch.equal(parse_routed_experts(X.numpy(), num_tokens=3, **SHAPE), out)
    later = parse_routed_experts(wire(X), num_tokens=5, start_len=2, **SHAPE)
    assert (later[:2] == -1).all() and torch.equal(later[2:], out)
    assert parse_routed_experts(wire(X), num_tokens=3, moe_layers=2, topk=2, num_experts=40000).dtype == torch.int32


@pytest.mark.parametrize("data, kw, message", [
    (wire(X), dict(moe_layers=5), r"has 48 bytes, not a multiple of 4 x moe_layers \(5\) x topk \(2\) = 40: .*"
                                  r"the model's \[tokens, moe_layers=5, topk=2\]"),
    # a layer count whose byte count happens to divide: the position count then differs
    (wire(X), dict(moe_layers=3), r"covers 2 positions .* \(shape \[2, 3, 2\] vs \[3, 3, 2\]\)"),
    (X.tolist(), dict(moe_layers=3), r"has shape \[3, 2, 2\], not the model's \[tokens, moe_layers=3, topk=2\]"),
    (X.tolist(), dict(topk=1), r"has shape \[3, 2, 2\], not the model's \[tokens, moe_layers=2, topk=1\]"),
    (wire(X), dict(num_experts=3), r"has expert id 3 outside \[0, num_experts=3\)"),
    ((X - 1).tolist(), {}, r"has expert id -1 outside \[0, num_experts=4\)"),
    (wire(X), dict(num_tokens=4), r"covers 3 positions from routed_experts_start_len=0, fewer than the 4 of the "
                                  r"sequence's 4 routed tokens \(shape \[3, 2, 2\] vs \[4, 2, 2\]\)"),
    (wire(X), dict(num_tokens=2), r"covers 3 positions .* more than the 2"),
    ("not base64!", {}, r"routed_experts is not base64"),
    (X.float().tolist(), {}, r"must hold integer expert ids, got dtype torch.float32"),
    (wire(X), dict(topk=5), r"topk=5 exceeds num_experts=4"),
    (wire(X), dict(start_len=-1), r"start_len must be an int >= 0, got -1"),
])
def test_bad_routed_experts_are_one_line(data, kw, message):
    args = dict(num_tokens=3, **SHAPE) | kw
    with pytest.raises(ValueError, match=message) as e:
        parse_routed_experts(data, **args)
    assert "\n" not in str(e.value)
