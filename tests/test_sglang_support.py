"""The sampling support of an SGLang response: parsed into the packed CSR, validated, carried by collate.

Payloads come from the model of SGLang 0.5.23's output (``tests/_sglang_server_model.py``: ``output_token_
sampling_mask``, one id list per token) and from slime's wire shape (``top_p_token_ids`` / ``top_p_token_offsets``,
base64 of little-endian int32; slime ``slime/utils/types.py`` at 624b824a89).
"""

from __future__ import annotations

import base64
import math

import numpy as np
import pytest
import torch
from _sglang_server_model import DONE, STOP, RequestState

from slime_tis.sglang import (
    SUPPORT_INVALID_METRIC,
    SGLangLogprobError,
    TrajectoryBuilder,
    collate,
    merge_stream_chunks,
    parse_generate_response,
)

V = 12


def _sampled(supports, tokens, *, stream=False):
    """One request through the SGLang model: token ``t`` drawn from ``supports[t]`` (uniform log-probs)."""
    st = RequestState("s", stream=stream, sampling_mode="selected")
    outs = []
    for t, (sup, tok) in enumerate(zip(supports, tokens)):
        lps = [-math.log(len(sup))] * len(sup)
        fin = STOP if t == len(tokens) - 1 else None
        outs.append(st.step([-2.0], [tok], finish=fin, support=[sup], support_lps=[lps]))
    return st, outs


def test_sampling_mask_packed_as_csr():
    supports, tokens = [[3, 1, 7], [5], list(range(V))], [1, 5, 11]
    _, outs = _sampled(supports, tokens)
    s = parse_generate_response(outs[-1], rollout_logprobs="sampling", sampling_support=True, vocab_size=V)
    assert not s.rejected and s.support.ids.dtype == torch.int32 and s.support.offsets.dtype == torch.int64
    assert s.support.offsets.tolist() == [0, 3, 4, 4 + V]
    assert s.support.ids.tolist() == [3, 1, 7, 5, *range(V)]
    assert s.rollout_log_probs.tolist() == pytest.approx([-math.log(3), 0.0, -math.log(V)], abs=1e-6)
    # log kept mass = full-distribution log-prob (-2.0 in these payloads) - sampling log-prob
    assert s.rollout_log_mass.tolist() == pytest.approx([-2 + math.log(3), -2.0, -2 + math.log(V)], abs=1e-6)
    assert parse_generate_response(outs[-1]).rollout_log_mass is None


def test_sampling_mask_through_a_stream():
    supports, tokens = [[3, 1], [5, 2], [0]], [1, 2, 0]
    st, outs = _sampled(supports, tokens, stream=True)
    merged = merge_stream_chunks([st.drain(o) for o in outs] + [DONE])
    s = parse_generate_response(merged, rollout_logprobs="sampling", sampling_support=True, vocab_size=V)
    assert not s.rejected and s.support.offsets.tolist() == [0, 2, 4, 5] and s.support.ids.tolist() == [3, 1, 5, 2, 0]


def _b64(values):
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode("ascii")


@pytest.mark.parametrize("encode", [_b64, list])
@pytest.mark.parametrize("keys", [("top_p_token_ids", "top_p_token_offsets"),
                                  ("top_p_kept_token_ids", "top_p_kept_token_offsets")])
def test_slime_top_p_ids_and_offsets(encode, keys):
    resp = {"output_ids": [4, 2], "meta_info": {
        "id": "r", "finish_reason": STOP, "output_token_logprobs": [[-0.5, 4, None], [-0.1, 2, None]],
        keys[0]: encode([4, 9, 2]), keys[1]: encode([0, 2, 3])}}
    s = parse_generate_response(resp, sampling_support=True, vocab_size=V)
    assert not s.rejected and s.support.ids.tolist() == [4, 9, 2] and s.support.offsets.tolist() == [0, 2, 3]


def test_slime_offsets_that_do_not_match_misalign_the_sequence():
    meta = {"id": "r", "finish_reason": STOP, "output_token_logprobs": [[-0.5, 4, None], [-0.1, 2, None]],
            "top_p_token_ids": _b64([4, 2]), "top_p_token_offsets": _b64([0, 1])}
    s = parse_generate_response({"meta_info": meta}, sampling_support=True, vocab_size=V)
    assert s.misaligned and s.loss_mask.sum() == 0 and s.support.num_rows == 2
    assert "len(top_p_token_offsets) = 2 but len(output_token_logprobs) + 1 = 3" in s.reasons[0]
    meta["top_p_token_offsets"] = _b64([0, 2, 1])
    s = parse_generate_response({"meta_info": meta}, sampling_support=True, vocab_size=V)
    assert s.misaligned and "never decrease" in s.reasons[0]


@pytest.mark.parametrize("support, token, rule", [
    ([3, 4], 5, "sampled token outside its sampling support"),
    ([5, V], 5, f"sampling support id(s) outside [0, {V})"),
    ([5, -1], 5, f"sampling support id(s) outside [0, {V})"),
    ([], 5, "empty sampling support"),
    ([5, 5], 5, "sampling support with a repeated id"),
    (list(range(V)) + [5], 5, f"sampling support longer than the vocabulary ({V})"),
])
def test_bad_support_rejects_the_sequence_with_a_reason_and_a_count(support, token, rule):
    good = [[1, 2], [5, 6]]
    _, outs = _sampled([good[0], [token], good[1]], [1, token, 5])
    outs[-1]["meta_info"]["output_token_sampling_mask"][1] = support   # what a faulty engine would send
    s = parse_generate_response(outs[-1], rollout_logprobs="sampling", sampling_support=True, vocab_size=V)
    assert s.rejected and s.support_invalid and not s.misaligned
    assert any(r == f"1 token(s) with {rule} at generated token(s) 1" for r in s.reasons), s.reasons
    lp = s.rollout_log_probs
    assert math.isnan(lp[1]) and not lp[[0, 2]].isnan().any() and s.loss_mask.tolist() == [1, 1, 1]
    # the bad row is emptied (never replayed, never the full vocabulary); the good rows are kept
    assert s.support.offsets.tolist() == [0, 2, 2, 4] and s.support.ids.tolist() == [1, 2, 5, 6]
    _, ok = _sampled(good, [1, 5])
    batch = collate([s, parse_generate_response(ok[-1], rollout_logprobs="sampling", sampling_support=True,
                                                vocab_size=V)])
    assert batch.metrics[SUPPORT_INVALID_METRIC].item() == 0.5
    assert batch.metrics["sglang/rejected_seq_fraction"].item() == 0.5
    assert batch.metrics["sglang/nonfinite_seq_fraction"].item() == 0.0


def test_raise_mode_and_missing_support():
    _, outs = _sampled([[5]], [5])
    outs[-1]["meta_info"]["output_token_sampling_mask"][0] = [3, 4]
    with pytest.raises(SGLangLogprobError, match="sampled token outside its sampling support"):
        parse_generate_response(outs[-1], sampling_support=True, vocab_size=V, on_error="raise")
    plain = {"meta_info": {"id": "r", "finish_reason": STOP, "output_token_logprobs": [[-0.5, 4, None]]}}
    with pytest.raises(SGLangLogprobError, match='"return_sampling_mask": true'):
        parse_generate_response(plain, sampling_support=True, vocab_size=V)
    with pytest.raises(ValueError, match="sampling_support=True needs vocab_size, an int >= 1, got None"):
        parse_generate_response(plain, sampling_support=True)
    half = {"meta_info": {**plain["meta_info"], "top_p_token_ids": [4]}}
    with pytest.raises(SGLangLogprobError, match="only one of slime's top-p token ids / offsets"):
        parse_generate_response(half, sampling_support=True, vocab_size=V)


def test_collate_and_trajectory_carry_the_packed_support():
    _, a = _sampled([[1, 2], [3]], [2, 3])
    _, b = _sampled([[0, 4, 5]], [4])
    traj = TrajectoryBuilder(rollout_logprobs="sampling", sampling_support=True, vocab_size=V)
    traj.add_response(a[-1])
    traj.add_tokens([9, 9])                 # tool tokens: empty rows, mask 0
    traj.add_response(b[-1])
    one = traj.build()
    assert not one.rejected and one.support.offsets.tolist() == [0, 2, 3, 3, 3, 6]
    _, c = _sampled([[7, 8]], [8])
    two = parse_generate_response(c[-1], rollout_logprobs="sampling", sampling_support=True, vocab_size=V)
    batch = collate([one, two])
    assert batch.support_offsets.tolist() == [0, 2, 3, 3, 3, 6, 8]
    assert batch.support_ids.tolist() == [1, 2, 3, 0, 4, 5, 7, 8]
    assert batch.support_offsets.numel() == batch.token_ids.numel() + 1
    assert batch.metrics[SUPPORT_INVALID_METRIC].item() == 0.0
    assert batch.rollout_log_mass.shape == batch.token_ids.shape and (batch.rollout_log_mass[2:4] == 0).all()
    plain = collate([parse_generate_response(c[-1])])
    assert plain.support_ids is None and SUPPORT_INVALID_METRIC not in plain.metrics
    with pytest.raises(ValueError, match="some samples carry a sampling support and some do not"):
        collate([two, parse_generate_response(c[-1])])
