"""SGLang /generate responses -> aligned rollout log-probs: hand-written responses in SGLang's format.

The response shape follows SGLang's tokenizer manager: top-level ``text`` / ``output_ids`` /
``meta_info``; ``meta_info.output_token_logprobs`` is a list of ``[logprob, token_id, text|None]``
plus ``output_token_logprobs_length`` and ``completion_tokens``.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from slime_tis.sglang import (
    SGLangLogprobError,
    TrajectoryBuilder,
    TruncatedSamplingWarning,
    check_sampling_params,
    collate,
    generate_request,
    merge_stream_batch,
    merge_stream_chunks,
    parse_generate_response,
    sampling,
)


def response(lps, ids, *, output_ids="same", completion=None, rid="r0", text=None):
    entries = [[lp, tid, None] for lp, tid in zip(lps, ids)]
    meta = {
        "id": rid,
        "finish_reason": {"type": "length", "length": len(ids)},
        "prompt_tokens": 4,
        "completion_tokens": len(ids) if completion is None else completion,
        "output_token_logprobs": entries,
        "output_token_logprobs_length": len(entries),
        "input_token_logprobs": [[None, 1, None], [-2.0, 2, None]],
    }
    out = {"text": text or "".join(f"<{t}>" for t in ids), "meta_info": meta}
    out["output_ids"] = list(ids) if output_ids == "same" else output_ids
    return out


# ------------------------------------------------------------------ single turn
def test_single_turn_values_and_ids_exact():
    r = response([-0.5, -1.25, -0.0, -3.0], [11, 7, 7, 2])
    s = parse_generate_response(r)
    assert s.token_ids.tolist() == [11, 7, 7, 2]
    assert s.token_ids.dtype == torch.int64
    assert s.rollout_log_probs.dtype == torch.float32
    assert s.rollout_log_probs.tolist() == [-0.5, -1.25, 0.0, -3.0]
    assert s.loss_mask.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert not s.rejected and s.reasons == []


def test_ids_come_from_logprob_entries_not_text():
    r = response([-0.1, -0.2], [5, 6], text="completely different text")
    r.pop("output_ids")
    s = parse_generate_response(r)
    assert s.token_ids.tolist() == [5, 6]


def test_text_entries_are_accepted():
    r = response([-0.1, -0.2], [5, 6])
    r["meta_info"]["output_token_logprobs"] = [[-0.1, 5, "he"], [-0.2, 6, "llo"]]
    assert parse_generate_response(r).token_ids.tolist() == [5, 6]


def test_empty_generation_is_a_zero_length_sample():
    s = parse_generate_response(response([], []))
    assert s.length == 0 and not s.rejected


# ------------------------------------------------------------------ rejected: values
def test_none_logprob_rejects_sequence_keeps_mask_places_nan():
    s = parse_generate_response(response([-0.1, None, -0.3], [1, 2, 3]))
    assert s.rejected and s.nonfinite and not s.misaligned
    assert s.reasons == ["1 None log-prob(s) at generated token(s) 1"]
    assert s.loss_mask.tolist() == [1.0, 1.0, 1.0]  # denominator untouched; the core rejects via NaN
    assert math.isnan(s.rollout_log_probs[1].item())
    assert s.rollout_log_probs[0].item() == pytest.approx(-0.1)


@pytest.mark.parametrize(
    ("bad", "kind"),
    [(float("nan"), "NaN"), (float("inf"), "infinite"), (float("-inf"), "infinite"), (0.5, "positive")],
)
def test_nonfinite_or_positive_logprob_rejected(bad, kind):
    s = parse_generate_response(response([-0.1, -0.2, bad], [1, 2, 3]))
    assert s.rejected and s.nonfinite
    assert s.reasons == [f"1 {kind} log-prob(s) at generated token(s) 2"]
    assert math.isnan(s.rollout_log_probs[2].item())


def test_nan_from_json_token_roundtrip():
    raw = json.dumps(response([-0.1, float("nan")], [1, 2]))
    assert "NaN" in raw
    s = parse_generate_response(json.loads(raw))
    assert s.rejected and s.reasons == ["1 NaN log-prob(s) at generated token(s) 1"]


def test_tiny_positive_within_tolerance_is_kept():
    s = parse_generate_response(response([1e-6, -0.2], [1, 2]))
    assert not s.rejected


def test_raise_mode_message_names_request_and_positions():
    msg = r"request 'r0': 2 None log-prob\(s\) at generated token\(s\) 0, 2"
    with pytest.raises(SGLangLogprobError, match=msg):
        parse_generate_response(response([None, -0.2, None], [1, 2, 3]), on_error="raise")


# ------------------------------------------------------------------ rejected: alignment
def test_off_by_one_shift_against_output_ids_is_named():
    # output_token_logprobs ids shifted one position against output_ids (the classic bug)
    r = response([-0.1, -0.2, -0.3, -0.4], [9, 1, 2, 3], output_ids=[1, 2, 3, 4])
    s = parse_generate_response(r)
    assert s.rejected and s.misaligned
    assert s.reasons == [
        "token ids of output_token_logprobs differ from output_ids at position 0 (9 vs 1) "
        "(the two lists are shifted by one position: off-by-one)"
    ]
    assert s.loss_mask.sum().item() == 0.0
    assert torch.isnan(s.rollout_log_probs).all()


def test_extra_token_length_mismatch():
    r = response([-0.1, -0.2, -0.3], [1, 2, 3], output_ids=[1, 2, 3, 4], completion=4)
    with pytest.raises(SGLangLogprobError) as exc:
        parse_generate_response(r, on_error="raise")
    msg = str(exc.value)
    assert "len(output_token_logprobs) = 3 but meta_info['completion_tokens'] = 4" in msg
    assert "len(output_token_logprobs) = 3 but len(output_ids) = 4" in msg
    assert "(output_ids has one extra token at the end: off-by-one)" in msg


def test_logprob_length_field_mismatch():
    r = response([-0.1, -0.2], [1, 2])
    r["meta_info"]["output_token_logprobs_length"] = 3
    s = parse_generate_response(r)
    assert s.reasons == ["len(output_token_logprobs) = 2 but meta_info['output_token_logprobs_length'] = 3"]


# ------------------------------------------------------------------ usage errors (always raise)
def test_missing_return_logprob_raises_with_hint():
    r = {"text": "x", "output_ids": [1], "meta_info": {"id": "a", "completion_tokens": 1}}
    with pytest.raises(SGLangLogprobError, match='"return_logprob": true'):
        parse_generate_response(r)


def test_malformed_entry_raises():
    r = response([-0.1], [1])
    r["meta_info"]["output_token_logprobs"] = [[-0.1]]
    with pytest.raises(SGLangLogprobError, match=r"output_token_logprobs\[0\] must be \[logprob, token_id"):
        parse_generate_response(r)
    r["meta_info"]["output_token_logprobs"] = [[-0.1, "7", None]]
    with pytest.raises(SGLangLogprobError, match="non-integer token id '7'"):
        parse_generate_response(r)


def test_not_a_response_raises():
    with pytest.raises(SGLangLogprobError, match="no 'meta_info'"):
        parse_generate_response({"text": "x"})
    with pytest.raises(TypeError, match="response must be a dict"):
        parse_generate_response([response([-0.1], [1])])
    with pytest.raises(ValueError, match="on_error must be 'reject' or 'raise', got 'ignore'"):
        parse_generate_response(response([-0.1], [1]), on_error="ignore")


# ------------------------------------------------------------------ multi-turn with tool tokens
def test_multi_turn_tool_tokens_have_mask_zero():
    traj = TrajectoryBuilder()
    traj.add_response(response([-0.1, -0.2], [10, 11], rid="t0"))
    traj.add_tokens([50, 51, 52])  # tool output, no log-prob
    traj.add_response(response([-0.3], [12], rid="t1"))
    s = traj.build()
    assert s.token_ids.tolist() == [10, 11, 50, 51, 52, 12]
    assert s.loss_mask.tolist() == [1, 1, 0, 0, 0, 1]
    assert s.rollout_log_probs.tolist() == pytest.approx([-0.1, -0.2, 0.0, 0.0, 0.0, -0.3])
    assert not s.rejected


def test_multi_turn_rejected_turn_rejects_trajectory_with_turn_in_reason():
    traj = TrajectoryBuilder()
    traj.add_response(response([-0.1], [10]))
    traj.add_tokens([50])
    traj.add_response(response([None, -0.3], [12, 13]))
    s = traj.build()
    assert s.rejected and s.nonfinite
    assert s.reasons == ["turn 1: 1 None log-prob(s) at generated token(s) 0"]
    assert s.loss_mask.tolist() == [1, 0, 1, 1]


def test_multi_turn_misaligned_turn_masks_everything():
    traj = TrajectoryBuilder()
    traj.add_response(response([-0.1], [10]))
    traj.add_tokens([50])
    traj.add_response(response([-0.2, -0.3], [12, 13], output_ids=[12]))
    s = traj.build()
    assert s.misaligned and s.loss_mask.sum().item() == 0


def test_empty_trajectory_raises():
    with pytest.raises(SGLangLogprobError, match="empty trajectory"):
        TrajectoryBuilder().build()


# ------------------------------------------------------------------ streaming
def sse(chunks):
    return [f"data: {json.dumps(c)}" for c in chunks] + ["", "data: [DONE]"]


def stream_chunks(lps, ids, sizes, *, incremental, drop_length=False):
    """SGLang-style chunks: cumulative (default server) or incremental (--incremental-streaming-output);
    ``finish_reason`` is null until the last chunk (a faithful model of SGLang 0.5.23's chunks, with the
    late-serialisation race, is in ``_sglang_server_model.py``)."""
    chunks, end = [], 0
    for k, size in enumerate(sizes):
        start, end = end, end + size
        lo = start if incremental else 0
        meta = {
            "id": "s",
            "finish_reason": {"type": "length", "length": end} if k == len(sizes) - 1 else None,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps[lo:end], ids[lo:end])],
            "output_token_logprobs_length": end,
            "completion_tokens": end,
        }
        if drop_length:
            del meta["output_token_logprobs_length"]
        chunks.append({"text": "", "output_ids": ids[lo:end], "meta_info": meta})
    return chunks


LPS = [-0.1, -0.2, -0.3, -0.4, -0.5]
IDS = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("drop_length", [False, True])
def test_stream_modes_merge_to_the_full_response(incremental, drop_length):
    lines = sse(stream_chunks(LPS, IDS, [2, 1, 2], incremental=incremental, drop_length=drop_length))
    merged = merge_stream_chunks(lines)
    s = parse_generate_response(merged)
    assert s.token_ids.tolist() == IDS
    assert s.rollout_log_probs.tolist() == pytest.approx(LPS)
    assert not s.rejected


def test_stream_bytes_and_forced_mode():
    lines = [ln.encode() for ln in sse(stream_chunks(LPS, IDS, [1, 1, 1, 1, 1], incremental=True))]
    merged = merge_stream_chunks(lines, incremental=True)
    assert [e[1] for e in merged["meta_info"]["output_token_logprobs"]] == IDS


def test_stream_repeated_identical_tokens_incremental_with_length_field():
    # a degenerate repetition (same token, same log-prob) is only unambiguous thanks to the length field
    lps, ids = [-0.01] * 3, [7] * 3
    merged = merge_stream_chunks(sse(stream_chunks(lps, ids, [1, 1, 1], incremental=True)))
    assert len(merged["meta_info"]["output_token_logprobs"]) == 3


def test_stream_inconsistent_cumulative_chunks_raise():
    chunks = stream_chunks(LPS, IDS, [2, 3], incremental=False)
    chunks[1]["meta_info"]["output_token_logprobs"][0][0] = -9.0  # history rewritten
    with pytest.raises(SGLangLogprobError, match="does not extend the 2 entries"):
        merge_stream_chunks(chunks, incremental=False)


def test_stream_length_field_that_does_not_add_up_raises():
    chunks = stream_chunks(LPS, IDS, [2, 2], incremental=True)
    chunks[1]["meta_info"]["output_token_logprobs_length"] = 7
    with pytest.raises(SGLangLogprobError, match="do not add up to output_token_logprobs_length = 7"):
        merge_stream_chunks(chunks)


def test_stream_with_none_entry_is_rejected_after_merge():
    lps = [-0.1, None, -0.3]
    merged = merge_stream_chunks(sse(stream_chunks(lps, [1, 2, 3], [1, 2], incremental=True)))
    s = parse_generate_response(merged)
    assert s.rejected and s.reasons == ["1 None log-prob(s) at generated token(s) 1"]


def test_stream_batch_by_index_and_errors():
    a = stream_chunks(LPS[:2], IDS[:2], [1, 1], incremental=True)
    b = stream_chunks(LPS[2:], IDS[2:], [3], incremental=True)
    for c in a:
        c["index"] = 0
    for c in b:
        c["index"] = 1
    interleaved = [a[0], b[0], a[1]]
    merged = merge_stream_batch(interleaved, num_requests=2)
    assert [[e[1] for e in m["meta_info"]["output_token_logprobs"]] for m in merged] == [IDS[:2], IDS[2:]]
    with pytest.raises(SGLangLogprobError, match="use merge_stream_batch"):
        merge_stream_chunks(interleaved)
    with pytest.raises(SGLangLogprobError, match="empty stream"):
        merge_stream_chunks(["data: [DONE]"])
    with pytest.raises(SGLangLogprobError, match="not a server-sent 'data:' line"):
        merge_stream_chunks(["event: x"])
    with pytest.raises(SGLangLogprobError, match="server error"):
        merge_stream_chunks(['data: {"error": "boom"}'])


# ------------------------------------------------------------------ collate
def test_collate_packs_and_counts_rejections():
    good = parse_generate_response(response([-0.1, -0.2], [1, 2]))
    nonfinite = parse_generate_response(response([None], [3]))
    misaligned = parse_generate_response(response([-0.1, -0.2], [4, 5], output_ids=[4]))
    traj = TrajectoryBuilder()
    traj.add_response(response([-0.4], [6]))
    traj.add_tokens([60, 61])
    b = collate([good, nonfinite, misaligned, traj.build()])
    assert b.cu_seqlens.tolist() == [0, 2, 3, 5, 8]
    assert b.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 60, 61]
    assert b.loss_mask.tolist() == [1, 1, 1, 0, 0, 1, 0, 0]
    assert b.rejected.tolist() == [False, True, True, False]
    assert b.metrics["sglang/rejected_seq_fraction"].item() == 0.5
    assert b.metrics["sglang/misaligned_seq_fraction"].item() == 0.25
    assert b.metrics["sglang/nonfinite_seq_fraction"].item() == 0.25
    with pytest.raises(ValueError, match="at least one sample"):
        collate([])


# ------------------------------------------------------------------ top-p / top-k guard
@pytest.fixture(autouse=True)
def _fresh_guard(monkeypatch):
    monkeypatch.delenv("SLIME_TIS_RENORMALIZED_LOGPROBS", raising=False)
    monkeypatch.setattr(sampling, "_WARNED", set())  # each test sees the first warning of its settings


def test_top_p_warns_once_loudly(caplog):
    with pytest.warns(TruncatedSamplingWarning, match=r"top_p=0\.9.*biased by the kept mass"):
        c = check_sampling_params({"temperature": 1.0, "top_p": 0.9})
    assert c.truncated and c.biased and c.warned
    assert any("top_p=0.9" in rec.getMessage() for rec in caplog.records if rec.levelname == "WARNING")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second warning would raise
        c2 = check_sampling_params({"top_p": 0.9})
    assert c2.biased and not c2.warned


def test_top_k_and_min_p_warn():
    with pytest.warns(TruncatedSamplingWarning, match=r"top_k=50"):
        check_sampling_params({"top_k": 50})
    with pytest.warns(TruncatedSamplingWarning, match=r"min_p=0\.05"):
        check_sampling_params({"min_p": 0.05})


@pytest.mark.parametrize("params", [{}, {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "temperature": 0.7}, None])
def test_untruncated_sampling_is_silent(params):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = check_sampling_params(params)
    assert not c.truncated and not c.biased


def test_declared_renormalised_logprobs_silence_the_warning(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = check_sampling_params({"top_p": 0.8}, renormalized_logprobs=True)
        assert c.truncated and not c.biased
        monkeypatch.setenv("SLIME_TIS_RENORMALIZED_LOGPROBS", "1")
        assert not check_sampling_params({"top_k": 20}).biased


@pytest.mark.parametrize(
    ("params", "msg"),
    [
        ({"top_p": 0.0}, r"sampling_params\['top_p'\] must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"must be in \(0, 1\], got 1.5"),
        ({"top_k": 0}, r"sampling_params\['top_k'\] must be -1 \(disabled\) or >= 1, got 0"),
        ({"min_p": -0.1}, r"sampling_params\['min_p'\] must be in \[0, 1\], got -0.1"),
        ({"temperature": -1}, r"sampling_params\['temperature'\] must be >= 0, got -1.0"),
    ],
)
def test_invalid_sampling_params(params, msg):
    with pytest.raises(ValueError, match=msg):
        check_sampling_params(params)
    with pytest.raises(TypeError, match=r"sampling_params\['top_p'\] must be a number, got '0.9'"):
        check_sampling_params({"top_p": "0.9"})


def test_parse_with_sampling_params_and_generate_request_warn():
    with pytest.warns(TruncatedSamplingWarning):
        parse_generate_response(response([-0.1], [1]), sampling_params={"top_p": 0.95})
    sampling._WARNED.clear()
    with pytest.warns(TruncatedSamplingWarning):
        req = generate_request([1, 2, 3], {"top_k": 40, "max_new_tokens": 8})
    assert req == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"top_k": 40, "max_new_tokens": 8},
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }
    with pytest.raises(ValueError, match="input_ids must contain at least one prompt token"):
        generate_request([], {})


def test_slimes_replay_of_the_truncated_support_is_not_biased():
    """slime (--rollout-top-p < 1) asks for the kept ids, its SGLang renormalises over them and its trainer masks
    its logits to them: no bias, no warning, nothing to declare. Top-k alone or the parameter with top-p 1 is not
    replayed by slime's trainer."""
    replay = {"custom_params": {"return_top_p_token_ids": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = check_sampling_params({"top_p": 0.9, "top_k": 50, **replay})
    assert c.truncated and c.replayed and not c.biased and not c.warned
    for params in ({"top_k": 50, **replay}, {"top_p": 0.9, "custom_params": {"return_top_p_token_ids": "yes"}},
                   {"top_p": 0.95, "custom_params": {"other": True}}):
        with pytest.warns(TruncatedSamplingWarning, match=r"--rollout-top-p < 1 so that slime replays"):
            c = check_sampling_params(params)
        assert c.biased and not c.replayed
