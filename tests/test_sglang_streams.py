"""SGLang streams, finish reasons, top-k default and sampling log-probs.

Payloads come from ``tests/_sglang_server_model.py``, a model of SGLang 0.5.23's own response code
(``tokenizer_manager.py``, ``http_server.py``, ``schedule_batch.py``, ``sampling_mask.py``,
``sampling_params.py``; see that file), not from what our parser expects.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _sglang_server_model import DONE, NAN_STOP, STOP, RequestState, abort_finish, length_finish

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

LPS = [-0.25, -1.5, -0.125, -3.0, -0.5, -2.25]
IDS = [17, 4, 4, 99, 31, 2]


@pytest.fixture(autouse=True)
def _fresh_guard(monkeypatch):
    monkeypatch.delenv("SLIME_TIS_RENORMALIZED_LOGPROBS", raising=False)
    monkeypatch.setattr(sampling, "_WARNED", set())  # each test sees the first warning of its settings


def stream_lines(steps, *, incremental=False, done=True, finish=STOP, rid="r"):
    """SSE lines of one streamed request generated in ``steps`` (token counts per output batch)."""
    st = RequestState(rid, incremental=incremental)
    lines, end = [], 0
    for k, size in enumerate(steps):
        lo, end = end, end + size
        fin = finish if k == len(steps) - 1 else None
        lines.append(st.drain(st.step(LPS[lo:end], IDS[lo:end], finish=fin)))
    return lines + ([DONE] if done else [])


# ------------------------------------------------------------------ cut-off streams
@pytest.mark.parametrize("incremental", [False, True])
def test_stream_cut_off_before_finishing_chunk_is_rejected_and_counted(incremental):
    full = stream_lines([2, 2, 2], incremental=incremental)
    cut = full[:2]  # the connection dropped after 4 of 6 tokens: no finishing chunk, no [DONE]
    merged = merge_stream_chunks(cut)
    assert merged["stream"] == {"chunks": 2, "done": False, "ahead": 0, "finish_reason_seen": True}
    s = parse_generate_response(merged)
    assert s.rejected and s.finish_error == "unfinished" and not s.nonfinite
    assert s.reasons == [
        "the request had not finished (finish_reason null in the last of 2 stream chunk(s), no [DONE] line: "
        "the stream was cut off before its finishing chunk); its 4 received token(s) are not used"
    ]
    assert s.loss_mask.sum().item() == 0 and torch.isnan(s.rollout_log_probs).all()
    with pytest.raises(SGLangLogprobError, match="cut off before its finishing chunk"):
        parse_generate_response(merged, on_error="raise")

    clean = parse_generate_response(merge_stream_chunks(full))
    assert not clean.rejected and clean.finish_error is None
    assert clean.token_ids.tolist() == IDS and clean.rollout_log_probs.tolist() == LPS
    b = collate([clean, s])
    assert b.metrics["sglang/unfinished_seq_fraction"].item() == 0.5
    assert b.metrics["sglang/rejected_seq_fraction"].item() == 0.5
    assert b.metrics["sglang/aborted_seq_fraction"].item() == 0.0


def test_stream_without_finishing_chunk_is_rejected_even_with_done():
    lines = stream_lines([3, 3])
    lines = lines[:1] + [DONE]  # finishing chunk lost, [DONE] still sent
    s = parse_generate_response(merge_stream_chunks(lines))
    assert s.finish_error == "unfinished" and "then [DONE]" in s.reasons[0]


def test_batch_stream_one_request_cut_off_others_kept():
    a, b = RequestState("a"), RequestState("b")
    lines = [a.drain(a.step(LPS[:2], IDS[:2]), 0), b.drain(b.step(LPS[:3], IDS[:3]), 1),
             b.drain(b.step(LPS[3:], IDS[3:], finish=STOP), 1)]  # a's stream stops: cut off
    merged = merge_stream_batch(lines, num_requests=2)
    sa, sb = (parse_generate_response(m) for m in merged)
    assert sa.finish_error == "unfinished" and sa.rejected
    assert not sb.rejected and sb.token_ids.tolist() == IDS


# ------------------------------------------------------------------ lists grown past the length field
def test_batch_stream_chunk_serialised_after_its_lists_grew():
    """n > 1: the chunk of request 0 built at step 1 waits while request 1's chunk is sent; meanwhile the
    tokenizer manager handles step 2 and extends request 0's lists in place (SGLang passes them by
    reference), so the chunk goes out with 4 entries and output_token_logprobs_length = 2."""
    a, b = RequestState("a"), RequestState("b")
    a1 = a.step(LPS[:2], IDS[:2])
    b1 = b.step(LPS[:1], IDS[:1])
    lines = [b.drain(b1, 1)]
    a2 = a.step(LPS[2:4], IDS[2:4])  # handled before a1 is serialised
    lines.append(a.drain(a1, 0))
    lines.append(a.drain(a2, 0))
    b2 = b.step(LPS[1:3], IDS[1:3], finish=length_finish(3))
    a3 = a.step(LPS[4:], IDS[4:], finish=STOP)
    lines += [b.drain(b2, 1), a.drain(a3, 0), DONE]
    assert '"output_token_logprobs_length": 2' in lines[1] and lines[1].count("null]") == 4  # 4 entries, length 2

    ma, mb = merge_stream_batch(lines, num_requests=2)
    assert ma["stream"] == {"chunks": 3, "done": True, "ahead": 1, "finish_reason_seen": True}
    sa, sb = parse_generate_response(ma), parse_generate_response(mb)
    assert not sa.rejected and not sb.rejected, (sa.reasons, sb.reasons)
    assert sa.token_ids.tolist() == IDS and sa.rollout_log_probs.tolist() == LPS
    assert sb.token_ids.tolist() == IDS[:3] and sb.rollout_log_probs.tolist() == LPS[:3]


def test_cumulative_chunks_all_ahead_then_final():
    st = RequestState("r")
    outs = [st.step(LPS[:1], IDS[:1]), st.step(LPS[1:3], IDS[1:3]), st.step(LPS[3:], IDS[3:], finish=STOP)]
    lines = [st.drain(o) for o in outs] + [DONE]  # serialised after the last step: every chunk holds all 6
    m = merge_stream_chunks(lines)
    assert m["stream"]["ahead"] == 2
    assert parse_generate_response(m).rollout_log_probs.tolist() == LPS


def test_length_field_still_cross_checks():
    # incremental deltas that do not add up to the length field, and cumulative history rewritten: errors
    lines = stream_lines([2, 2, 2], incremental=True)
    with pytest.raises(SGLangLogprobError, match="do not add up to output_token_logprobs_length"):
        merge_stream_chunks([lines[0], lines[2]])  # a delta lost in between
    st = RequestState("r")
    first = st.drain(st.step(LPS[:2], IDS[:2]))
    st.output_token_logprobs[0] = (-9.0, IDS[0], None)
    second = st.drain(st.step(LPS[2:], IDS[2:], finish=STOP))
    with pytest.raises(SGLangLogprobError, match="does not extend the 2 entries"):
        merge_stream_chunks([first, second, DONE])


def test_cumulative_stream_with_nan_logprob_merges_and_is_rejected_as_nonfinite():
    st = RequestState("r")
    lps = [-0.5, float("nan"), -0.25]
    lines = [st.drain(st.step(lps[:2], [5, 6])), st.drain(st.step(lps[2:], [7], finish=STOP)), DONE]
    s = parse_generate_response(merge_stream_chunks(lines))
    assert s.nonfinite and s.finish_error is None and s.reasons == ["1 None log-prob(s) at generated token(s) 1"]


# ------------------------------------------------------------------ finish_reason
def response(finish, n=3):
    st = RequestState("q", stream=False)
    return st.step(LPS[:n], IDS[:n], finish=finish)


@pytest.mark.parametrize("finish", [STOP, length_finish(3), {"type": "stop", "matched": "</answer>"}])
def test_normal_finish_reasons_are_accepted(finish):
    s = parse_generate_response(response(finish))
    assert not s.rejected and s.finish_error is None


def test_abort_is_rejected_with_its_message_and_counted():
    s = parse_generate_response(response(abort_finish()))
    assert s.rejected and s.finish_error == "aborted" and s.loss_mask.sum().item() == 0
    assert s.reasons == ["SGLang aborted the request (finish_reason abort: message 'Aborted')"]
    msg = "Retracted under decode memory pressure without a KV backup. Retry later."
    with pytest.raises(SGLangLogprobError, match=r"request 'q': SGLang aborted the request \(finish_reason abort: "
                       r"message 'Retracted under decode memory pressure.*status_code 503"):
        parse_generate_response(response(abort_finish(msg, 503)), on_error="raise")


def test_nan_happened_stop_is_rejected_and_counted():
    s = parse_generate_response(response(NAN_STOP))
    assert s.rejected and s.finish_error == "nan_stop"
    assert "'NaN happened'" in s.reasons[0] and "outside the vocabulary" in s.reasons[0]
    ok = parse_generate_response(response(STOP))
    ab = parse_generate_response(response(abort_finish()))
    b = collate([ok, s, ab, ok])
    assert b.metrics["sglang/nan_stop_seq_fraction"].item() == 0.25
    assert b.metrics["sglang/aborted_seq_fraction"].item() == 0.25
    assert b.metrics["sglang/rejected_seq_fraction"].item() == 0.5
    assert b.loss_mask.tolist() == [1, 1, 1] + [0] * 6 + [1, 1, 1]


def test_streamed_abort_and_multi_turn_abort():
    lines = stream_lines([2, 1], finish=abort_finish("Aborted"))
    s = parse_generate_response(merge_stream_chunks(lines))
    assert s.finish_error == "aborted" and s.length == 3
    traj = TrajectoryBuilder()
    traj.add_response(response(STOP))
    traj.add_tokens([50, 51])
    traj.add_response(response(abort_finish(), n=2))
    t = traj.build()
    assert t.rejected and t.finish_error == "aborted" and t.loss_mask.sum().item() == 0
    assert t.reasons == ["turn 1: SGLang aborted the request (finish_reason abort: message 'Aborted')"]


# ------------------------------------------------------------------ top_k = TOP_K_ALL
@pytest.mark.parametrize("top_k", [1073741824, 1 << 31, -1])
def test_sglang_no_top_k_value_does_not_warn(top_k):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = check_sampling_params({"temperature": 1.0, "top_p": 1.0, "top_k": top_k, "min_p": 0.0})
        generate_request([1, 2], {"top_k": top_k})
    assert not c.truncated and not c.biased


def test_top_k_just_below_sglang_all_still_warns():
    with pytest.warns(TruncatedSamplingWarning, match="top_k=1073741823"):
        check_sampling_params({"top_k": 1073741823})


# ------------------------------------------------------------------ sampling log-probs
def truncated_distribution(seed, vocab=12, top_p=0.8):
    """Full and top-p-renormalised log-probs of one step, and the kept support (SGLang: top_p_renorm_prob;
    the selected log-prob is log(p_sel / S), sampler.py _build_sampling_mask_output)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=g, dtype=torch.float64) * 2
    p = torch.softmax(logits, 0)
    order = torch.argsort(p, descending=True)
    keep = (torch.cumsum(p[order], 0) - p[order]) < top_p
    support = order[keep]
    mass = p[support].sum()
    return p, support.tolist(), (torch.log(p[support] / mass)).tolist(), float(mass)


def sampled(seeds, mode="selected", stream=False, incremental=False):
    st = RequestState("s", stream=stream, incremental=incremental, sampling_mode=mode)
    full, trunc, masses, ids, outs = [], [], [], [], []
    for k, seed in enumerate(seeds):
        p, support, support_lps, mass = truncated_distribution(seed)
        tok = support[-1]  # a kept token (the least likely kept one)
        full.append(math.log(p[tok]))
        trunc.append(support_lps[-1])
        masses.append(mass)
        ids.append(tok)
        fin = STOP if k == len(seeds) - 1 else None
        outs.append(st.step([full[-1]], [tok], finish=fin, support=[support], support_lps=[support_lps]))
    return st, outs, ids, full, trunc, masses


@pytest.mark.parametrize("mode", ["selected", "support"])
def test_sampling_logprobs_used_as_pi_rollout(mode):
    _, outs, ids, full, trunc, masses = sampled([1, 2, 3, 4], mode=mode)
    resp = outs[-1]
    default = parse_generate_response(resp)
    assert default.rollout_log_probs.tolist() == pytest.approx(full, abs=1e-6)
    s = parse_generate_response(resp, rollout_logprobs="sampling")
    assert not s.rejected and s.token_ids.tolist() == ids
    assert s.rollout_log_probs.tolist() == pytest.approx(trunc, abs=1e-6)  # float32 storage
    # the two differ by exactly -log S_t, the kept mass the full-distribution log-prob ignores
    diff = (s.rollout_log_probs - default.rollout_log_probs).double()
    assert diff.tolist() == pytest.approx([-math.log(m) for m in masses], abs=2e-6)
    assert all(m < 1 for m in masses)


def test_sampling_logprobs_through_streams():
    for incremental in (False, True):
        st, outs, ids, _, trunc, _ = sampled([5, 6, 7], stream=True, incremental=incremental)
        lines = [st.drain(o) for o in outs] + [DONE]  # serialised late: cumulative lists ahead
        m = merge_stream_chunks(lines)
        assert m["meta_info"]["output_token_sampling_mask_length"] == 3
        s = parse_generate_response(m, rollout_logprobs="sampling")
        assert not s.rejected and s.token_ids.tolist() == ids
        assert s.rollout_log_probs.tolist() == pytest.approx(trunc, abs=1e-6)


def test_sampling_logprobs_errors():
    _, outs, *_ = sampled([1, 2])
    plain = response(STOP)
    with pytest.raises(SGLangLogprobError, match='"return_sampling_mask": true'):
        parse_generate_response(plain, rollout_logprobs="sampling")
    with pytest.raises(ValueError, match="rollout_logprobs must be 'full' or 'sampling', got 'x'"):
        parse_generate_response(plain, rollout_logprobs="x")
    short = outs[-1]
    short["meta_info"]["output_token_sampling_logprobs"] = short["meta_info"]["output_token_sampling_logprobs"][:1]
    s = parse_generate_response(short, rollout_logprobs="sampling")
    assert s.misaligned and s.reasons == [
        "len(output_token_sampling_logprobs) = 1 but len(output_token_logprobs) = 2"]
    _, outs, *_ = sampled([1, 2], mode="support")
    r = outs[-1]
    masks = r["meta_info"]["output_token_sampling_mask"]
    masks[1] = [t + 1000 for t in masks[1]]
    s = parse_generate_response(r, rollout_logprobs="sampling")
    assert s.nonfinite and s.reasons == ["1 sampled-token-outside-support log-prob(s) at generated token(s) 1"]


def test_top_p_warning_offers_sampling_logprobs_and_option_silences_it():
    with pytest.warns(TruncatedSamplingWarning, match=r'return_sampling_mask.*rollout_logprobs="sampling"'):
        check_sampling_params({"top_p": 0.9})
    sampling._WARNED.clear()
    _, outs, *_ = sampled([1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        parse_generate_response(outs[-1], sampling_params={"top_p": 0.8}, rollout_logprobs="sampling")
        body = generate_request([1, 2, 3], {"top_p": 0.8}, sampling_logprobs=True)
    assert body["return_sampling_mask"] is True and body["return_logprob"] is True
    traj = TrajectoryBuilder(rollout_logprobs="sampling")
    assert not traj.add_response(outs[-1]).rejected


# ------------------------------------------------------------------ SSE lines produced by SGLang 0.5.23's own code
def real_streams():
    """``tests/_sglang_streams_0_5_23.json`` (see its ``_source``): captured from SGLang 0.5.23's
    ``TokenizerManager._handle_batch_output`` + ``dumps_json``, serialised after every batch was handled."""
    import json
    from pathlib import Path

    return json.loads((Path(__file__).parent / "_sglang_streams_0_5_23.json").read_text())


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
def test_real_sglang_batched_stream(mode):
    lines = real_streams()[mode]
    if mode == "cumulative":  # the race is in the capture: 4 entries under output_token_logprobs_length = 2
        assert '"output_token_logprobs_length":2' in lines[0] and lines[0].count(",null]") == 4
    ma, mb = merge_stream_batch(lines, num_requests=2)
    sa, sb = parse_generate_response(ma), parse_generate_response(mb)
    assert not sa.rejected, sa.reasons
    assert sa.token_ids.tolist() == [11, 12, 13, 2] and sa.rollout_log_probs.tolist() == [-0.5, -1.0, -2.0, -0.75]
    assert ma["stream"] == {"chunks": 3, "done": True, "ahead": 2 if mode == "cumulative" else 0,
                            "finish_reason_seen": True}
    assert sb.rejected and sb.finish_error == "aborted" and sb.token_ids.tolist() == [21, 22, 23]
    assert sb.reasons == ["SGLang aborted the request (finish_reason abort: message 'Aborted')",
                          "1 None log-prob(s) at generated token(s) 2"]
    cut = merge_stream_batch(lines[:4], num_requests=2)  # connection lost before the finishing chunks
    assert [parse_generate_response(m).finish_error for m in cut] == ["unfinished", "unfinished"]
    b = collate([sa, sb, *(parse_generate_response(m) for m in cut)])
    assert b.metrics["sglang/unfinished_seq_fraction"].item() == 0.5
    assert b.metrics["sglang/aborted_seq_fraction"].item() == 0.25


def test_real_sglang_sampling_logprobs_stream():
    m = merge_stream_chunks(real_streams()["sampling_selected"])
    s = parse_generate_response(m, rollout_logprobs="sampling")
    assert not s.rejected and s.token_ids.tolist() == [11, 12, 14]
    assert s.rollout_log_probs.tolist() == pytest.approx([-0.3, 0.0, -0.9], abs=1e-7)
    assert parse_generate_response(m).rollout_log_probs.tolist() == [-0.5, -0.5, -0.75]


def test_chunks_without_output_ids_are_not_misaligned():
    """A server whose chunks carry no ``output_ids``: the merged response has none either, so the parser has
    nothing to compare the log-prob ids with and accepts the request."""
    chunks = [{"text": "a", "meta_info": {"output_token_logprobs": [[-0.1, 5, None]], "finish_reason": None}},
              {"text": "ab", "meta_info": {"output_token_logprobs": [[-0.1, 5, None], [-0.2, 6, None]],
                                           "finish_reason": {"type": "stop"}}}]
    merged = merge_stream_chunks(chunks)
    assert "output_ids" not in merged and merged["text"] == "ab"
    s = parse_generate_response(merged)
    assert not s.rejected and s.token_ids.tolist() == [5, 6]
