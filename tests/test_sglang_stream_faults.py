"""Hostile or broken SGLang streams: a request of a batch that sent nothing, finish reasons that are not
finish reasons, cumulative chunks that rewrite history, and long streams merged in linear time.

Payloads come from ``tests/_sglang_server_model.py`` (a model of SGLang 0.5.23's own response code)."""

from __future__ import annotations

import json
import time

import pytest
from _sglang_server_model import DONE, STOP, RequestState, length_finish, sse_line

from slime_tis.sglang import (
    SGLangLogprobError,
    collate,
    merge_stream_batch,
    merge_stream_chunks,
    parse_generate_response,
)

LPS = [-0.25, -1.5, -0.125, -3.0, -0.5, -2.25]
IDS = [17, 4, 4, 99, 31, 2]


def _request(index: int, lps, ids, *, incremental: bool = False) -> list[str]:
    """SSE lines of one request of a batch, one token per output batch, finishing with STOP."""
    st = RequestState(f"r{index}", incremental=incremental)
    lines = []
    for t in range(len(ids)):
        fin = STOP if t == len(ids) - 1 else None
        lines.append(st.drain(st.step(lps[t : t + 1], ids[t : t + 1], finish=fin), index))
    return lines


# ------------------------------------------------------------------ a request of the batch sent no chunk
@pytest.mark.parametrize("incremental", [False, True])
def test_batch_request_without_any_chunk_keeps_its_place_and_is_rejected(incremental):
    """Three requests; request 1's stream never arrives. Request 2's tokens must stay request 2's
    (result index 2), and request 1 is returned empty, rejected as unfinished and counted."""
    lines = _request(0, LPS[:3], IDS[:3], incremental=incremental) + _request(
        2, LPS[3:], IDS[3:], incremental=incremental
    )
    merged = merge_stream_batch([*lines, DONE], num_requests=3)
    assert [m["index"] for m in merged] == [0, 1, 2]
    s0, s1, s2 = (parse_generate_response(m) for m in merged)
    assert not s0.rejected and s0.token_ids.tolist() == IDS[:3]
    assert not s2.rejected and s2.token_ids.tolist() == IDS[3:]
    assert s1.rejected and s1.finish_error == "unfinished" and s1.length == 0
    assert "no stream chunk of request 1 of the batch was received" in s1.reasons[0]
    b = collate([s0, s1, s2])
    assert b.metrics["sglang/unfinished_seq_fraction"].item() == pytest.approx(1 / 3)
    assert b.metrics["sglang/rejected_seq_fraction"].item() == pytest.approx(1 / 3)


def test_batched_stream_needs_num_requests_so_that_a_silent_last_request_is_not_lost():
    """Requests 0 and 1 of a batch of three stream; request 2 sends nothing. Without the batch size the
    merger cannot know request 2 exists: it refuses (one line naming num_requests) instead of returning two
    results; with it, request 2 comes back empty, rejected and counted."""
    lines = _request(0, LPS[:2], IDS[:2]) + _request(1, LPS[2:4], IDS[2:4]) + [DONE]
    with pytest.raises(SGLangLogprobError, match=r"'index' 0: a batched stream needs num_requests"):
        merge_stream_batch(lines)
    merged = merge_stream_batch(lines, num_requests=3)
    assert [m["index"] for m in merged] == [0, 1, 2] and merged[2]["stream"]["chunks"] == 0
    samples = [parse_generate_response(m) for m in merged]
    assert [s.finish_error for s in samples] == [None, None, "unfinished"]
    assert collate(samples).metrics["sglang/unfinished_seq_fraction"].item() == pytest.approx(1 / 3)
    # gaps below the highest index are filled in their place
    merged = merge_stream_batch(_request(0, LPS[:2], IDS[:2]) + _request(2, LPS[2:4], IDS[2:4]), num_requests=3)
    assert [parse_generate_response(m).finish_error for m in merged] == [None, "unfinished", None]


def test_batch_trailing_missing_request_needs_num_requests_and_bad_index_is_an_error():
    merged = merge_stream_batch(_request(0, LPS[:2], IDS[:2]), num_requests=2)
    assert len(merged) == 2 and parse_generate_response(merged[1]).finish_error == "unfinished"
    with pytest.raises(SGLangLogprobError, match=r"'index' 2, expected \[0, 2\)"):
        merge_stream_batch(_request(2, LPS[:2], IDS[:2]), num_requests=2)
    with pytest.raises(SGLangLogprobError, match="'index' -1"):
        merge_stream_batch(_request(-1, LPS[:2], IDS[:2]), num_requests=2)
    with pytest.raises(SGLangLogprobError, match="needs num_requests"):
        merge_stream_batch(_request(10**9, LPS[:2], IDS[:2]))  # never allocates a billion placeholders
    with pytest.raises(ValueError, match="num_requests must be a positive int"):
        merge_stream_batch([], num_requests=0)
    # every request missing (an empty stream with a declared batch): all rejected and counted
    empty = merge_stream_batch([DONE], num_requests=2)
    assert [parse_generate_response(m).finish_error for m in empty] == ["unfinished", "unfinished"]


# ------------------------------------------------------------------ chunks that never carry finish_reason
def _no_finish_key(lines: list[str]) -> list[str]:
    """The same stream from a server whose chunks have no finish_reason key at all."""
    out = []
    for line in lines:
        chunk = json.loads(line[len("data: "):])
        del chunk["meta_info"]["finish_reason"]
        out.append(sse_line(chunk))
    return out


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_without_finish_reason_key_cut_short_is_unfinished(incremental):
    """Six chunks without any finish_reason key, cut after two with no [DONE]: nothing says the request
    finished, so the two tokens are not a (shorter) sample: rejected and counted as unfinished."""
    lines = _no_finish_key(_request(0, LPS, IDS, incremental=incremental))
    lines = [line.replace(', "index": 0', "") for line in lines]
    cut = parse_generate_response(merge_stream_chunks(lines[:2]))
    assert cut.rejected and cut.finish_error == "unfinished" and cut.loss_mask.sum().item() == 0
    assert "no finish_reason in any of 2 stream chunk(s), no [DONE] line" in cut.reasons[0]
    assert collate([cut]).metrics["sglang/unfinished_seq_fraction"].item() == 1.0
    # a chunk without the key after one that said null is no finish either, [DONE] or not
    with_key = _request(0, LPS, IDS, incremental=incremental)
    mixed = [line.replace(', "index": 0', "") for line in with_key[:1] + _no_finish_key(with_key[1:2])]
    assert parse_generate_response(merge_stream_chunks([*mixed, DONE])).finish_error == "unfinished"
    # the whole stream closed by [DONE]: a server that never sends the key, complete
    whole = parse_generate_response(merge_stream_chunks([*lines, DONE]))
    assert not whole.rejected and whole.token_ids.tolist() == IDS


# ------------------------------------------------------------------ SGLang's abort of a queued request
@pytest.mark.parametrize("incremental", [False, True])
def test_abort_in_waiting_queue_is_rejected_and_counted_not_a_stream_error(incremental):
    """Request 0 streams three tokens, is retracted to the waiting queue and aborted there: SGLang's
    ``_handle_abort_req`` chunk carries the whole log-prob list, the whole text and output_ids = [last id].
    That request is rejected and counted as aborted (with the abort message); request 1 of the batch is kept."""
    a, b = RequestState("a", incremental=incremental), RequestState("b", incremental=incremental)
    lines = [a.drain(a.step(LPS[:2], IDS[:2]), 0), b.drain(b.step(LPS[:3], IDS[:3]), 1),
             a.drain(a.step(LPS[2:3], IDS[2:3]), 0)]
    abort = a.abort_in_queue()
    assert abort["output_ids"] == [IDS[2]] and len(abort["meta_info"]["output_token_logprobs"]) == 3
    lines += [a.drain(abort, 0), b.drain(b.step(LPS[3:], IDS[3:], finish=STOP), 1), DONE]
    ma, mb = merge_stream_batch(lines, num_requests=2)
    sa, sb = parse_generate_response(ma), parse_generate_response(mb)
    assert sa.rejected and sa.finish_error == "aborted" and sa.loss_mask.sum().item() == 0
    assert sa.token_ids.tolist() == IDS[:3] and ma["output_ids"] == IDS[:3] and "abort_note" not in ma["stream"]
    assert sa.reasons == ["SGLang aborted the request (finish_reason abort: message 'Abort in waiting queue')"]
    assert not sb.rejected and sb.token_ids.tolist() == IDS
    b_ = collate([sa, sb])
    assert b_.metrics["sglang/aborted_seq_fraction"].item() == 0.5
    assert b_.metrics["sglang/rejected_seq_fraction"].item() == 0.5
    # aborted in the queue before its first token: one chunk, no tokens, rejected as aborted
    q = RequestState("q", incremental=incremental)
    s = parse_generate_response(merge_stream_chunks([q.drain(q.abort_in_queue()), DONE]))
    assert s.finish_error == "aborted" and s.length == 0
    # single request, incremental mode forced by the caller: same outcome
    a = RequestState("a", incremental=incremental)
    lines = [a.drain(a.step(LPS[:2], IDS[:2])), a.drain(a.step(LPS[2:4], IDS[2:4])), a.drain(a.abort_in_queue())]
    m = merge_stream_chunks([*lines, DONE], incremental=incremental)
    assert parse_generate_response(m).finish_error == "aborted" and m["output_ids"] == IDS[:4]


def test_abort_chunk_that_does_not_fit_ends_only_its_request():
    """An abort chunk whose lists contradict what was received still ends its request as aborted (the
    mismatch noted), never the whole batch; the same mismatch without the abort stays an error."""
    a, b = RequestState("a"), RequestState("b")
    lines = [a.drain(a.step(LPS[:3], IDS[:3]), 0), b.drain(b.step(LPS[:2], IDS[:2], finish=STOP), 1)]
    abort = a.abort_in_queue()
    abort["meta_info"]["output_token_logprobs"] = [[-9.0, 5, None]] * 3
    ma, mb = merge_stream_batch([*lines, a.drain(abort, 0), DONE], num_requests=2)
    assert parse_generate_response(ma).finish_error == "aborted" and "does not extend" in ma["stream"]["abort_note"]
    assert not parse_generate_response(mb).rejected
    abort["meta_info"]["finish_reason"] = STOP
    with pytest.raises(SGLangLogprobError, match="does not extend the 3 entries"):
        merge_stream_batch([*lines, a.drain(abort, 0), DONE], num_requests=2)


# ------------------------------------------------------------------ falsy finish reasons
@pytest.mark.parametrize("bogus", [False, 0, {}, "", {"type": ""}, {"type": None}, []])
def test_falsy_finish_reason_is_not_finished(bogus):
    st = RequestState("r")
    first = st.step(LPS[:2], IDS[:2])
    first["meta_info"]["finish_reason"] = bogus
    lines = [st.drain(first), st.drain(st.step(LPS[2:4], IDS[2:4], finish=STOP)), DONE]
    # the chunk with the bogus value does not end the request: the next chunk is merged, not refused
    m = merge_stream_chunks(lines)
    assert not parse_generate_response(m).rejected and m["output_ids"] == IDS[:4]
    # a stream that ends on it, or a non-streamed response carrying it, is rejected as unfinished
    cut = parse_generate_response(merge_stream_chunks(lines[:1]))
    assert cut.rejected and cut.finish_error == "unfinished"
    resp = RequestState("q", stream=False).step(LPS[:3], IDS[:3], finish=length_finish(3))
    resp["meta_info"]["finish_reason"] = bogus
    s = parse_generate_response(resp)
    assert s.rejected and s.finish_error == "unfinished" and "is not a finish reason" in s.reasons[0]


def test_string_finish_reason_still_finishes():
    resp = RequestState("q", stream=False).step(LPS[:3], IDS[:3], finish=length_finish(3))
    resp["meta_info"]["finish_reason"] = "stop"
    assert not parse_generate_response(resp).rejected


# ------------------------------------------------------------------ cumulative chunks rewriting history
@pytest.mark.parametrize("position", [1, 2, 4])
def test_cumulative_chunk_that_rewrites_an_earlier_entry_is_rejected(position):
    """Six tokens received, then a cumulative chunk that changes entry ``position`` (not only the first,
    middle or last one) must not pass."""
    st = RequestState("r")
    first = st.drain(st.step(LPS[:6], IDS[:6]))
    st.output_token_logprobs[position] = (-9.0, IDS[position], None)
    second = st.drain(st.step([-0.5], [3], finish=STOP))
    with pytest.raises(SGLangLogprobError, match="does not extend the 6 entries"):
        merge_stream_chunks([first, second, DONE])


def test_cumulative_chunk_that_rewrites_an_earlier_output_id_is_rejected():
    st = RequestState("r")
    first = st.drain(st.step(LPS[:4], IDS[:4]))
    out = st.step(LPS[4:], IDS[4:], finish=STOP)
    out["output_ids"][1] = 77
    with pytest.raises(SGLangLogprobError, match="output_ids do not extend the 4 ids"):
        merge_stream_chunks([first, sse_line(out), DONE])


# ------------------------------------------------------------------ long streams merge in linear time
@pytest.mark.timeout(120)
def test_long_incremental_stream_merges_in_linear_time():
    """200k one-token deltas: linear merging takes about a second of CPU; re-copying the ids received so far
    at every chunk (quadratic) takes ~40 s. Chunks are dicts (the JSON decoding is not what is measured)."""
    n = 200_000

    def chunks():
        for t in range(n):
            fin = {"type": "length", "length": n} if t == n - 1 else None
            meta = {"output_token_logprobs": [[-0.5, t % 50, None]], "output_token_logprobs_length": t + 1,
                    "finish_reason": fin}
            yield {"text": "x", "output_ids": [t % 50], "meta_info": meta}

    t0 = time.thread_time()  # CPU time of this thread: other processes on a busy machine do not count
    m = merge_stream_chunks(chunks(), incremental=True)
    elapsed = time.thread_time() - t0
    assert len(m["output_ids"]) == n and m["meta_info"]["output_token_logprobs_length"] == n
    assert elapsed < 10.0, f"merging {n} deltas took {elapsed:.1f} s of CPU"
