"""A small, faithful model of how SGLang 0.5.23 builds and serialises ``/generate`` output, to make
test payloads from SGLang's code rather than from our parser's expectations.

What it models (files of the sglang 0.5.23 wheel, ``python/sglang/srt/...``):

* ``managers/tokenizer_manager.py``, ``TokenizerManager._handle_batch_output``: per output batch,
  ``meta_info = {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions"}``; with
  ``return_logprob`` ``add_logprob_to_meta_info`` extends the request state's
  ``output_token_logprobs`` (``(logprob, token_id, None)`` tuples, ``detokenize_logprob_tokens``)
  and puts *the state's list itself* in ``meta_info`` with ``output_token_logprobs_length`` =
  its length at that moment; with ``return_sampling_mask`` the state's
  ``output_token_sampling_mask`` / ``output_token_sampling_logprobs`` lists (also by reference) and
  ``output_token_sampling_mask_length``; then ``reasoning_tokens``, ``completion_tokens``,
  ``cached_tokens``. Streaming, default (cumulative) mode: an intermediate chunk is
  ``{"text": None, "output_ids": state.output_ids, "meta_info": meta_info}`` -- "pass reference (no
  copy)" -- the finishing one copies ``output_ids`` and carries the full text;
  ``--incremental-streaming-output``: ``_slice_streaming_output_meta_info`` slices the per-token
  lists from the last offset (new lists) and ``output_ids`` / ``text`` are the deltas.
* ``TokenizerManager._stream_one_response``: the deferred ``text`` of a cumulative intermediate
  chunk is filled with the whole text so far when the chunk is drained; ``_stream_batch_responses``
  adds ``"index"`` to each chunk of a batched / ``n > 1`` request. A chunk is serialised only when
  its turn comes, so its referenced lists may have grown by then.
* ``TokenizerManager._handle_abort_req`` (an abort of a request waiting in the scheduler's queue, e.g.
  one retracted there after some tokens): ``meta_info = {"id", "finish_reason": {"type": "abort",
  "message": "Abort in waiting queue" or the request's message}, "weight_version", "e2e_latency"}``, with
  ``return_logprob`` the state's *whole* lists (``add_logprob_to_meta_info``, never sliced, in both
  streaming modes) and their length, ``completion_tokens = len(state.output_ids)``; ``output_ids`` is
  ``[state.output_ids[-1]]`` (``[]`` without tokens) when streaming, ``text`` the whole text.
* ``entrypoints/http_server.py``, ``serve_generate_request``: ``b"data: " + dumps_json(out) +
  b"\\n\\n"`` per chunk, then ``b"data: [DONE]\\n\\n"``; ``utils/json_response.py``: ``dumps_json`` is
  ``orjson.dumps``, which writes NaN / inf as ``null`` (modelled with ``json`` after that mapping).
* ``managers/schedule_batch.py``: ``finish_reason`` values ``FINISH_MATCHED_TOKEN`` ``{"type":
  "stop", "matched": id}``, ``FINISH_LENGTH`` ``{"type": "length", "length": n}``,
  ``FINISH_ABORT`` ``{"type": "abort", "message", "status_code", "err_type"}`` and the NaN stop
  ``FINISH_MATCHED_STR(matched="NaN happened")``.
* ``sampling/sampling_mask.py`` ``SamplingMaskChunk.to_lists``: "selected" mode gives one float
  per token, "support" mode one list per token aligned with the mask's token ids.
"""

from __future__ import annotations

import json
import math
from typing import Any

STOP = {"type": "stop", "matched": 2}


def length_finish(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


def abort_finish(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None):
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


NAN_STOP = {"type": "stop", "matched": "NaN happened"}


def _orjson_like(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (list, tuple)):
        return [_orjson_like(v) for v in x]
    if isinstance(x, dict):
        return {k: _orjson_like(v) for k, v in x.items()}
    return x


def sse_line(out: dict[str, Any]) -> str:
    return "data: " + json.dumps(_orjson_like(out)) + "\n\n"


DONE = "data: [DONE]\n\n"


class RequestState:
    """One request's ``ReqState`` on the tokenizer manager, and the chunk dicts it hands out."""

    def __init__(self, rid: str, *, stream: bool = True, incremental: bool = False, sampling_mode: str | None = None):
        self.rid = rid
        self.stream = stream
        self.incremental = incremental
        self.sampling_mode = sampling_mode  # None (no return_sampling_mask), "selected" or "support"
        self.output_token_logprobs: list[tuple] = []
        self.output_ids: list[int] = []
        self.text = ""
        self.sampling_mask: list[list[int]] = []
        self.sampling_logprobs: list[Any] = []
        self.last_output_offset = 0

    def step(self, lps, ids, *, finish=None, support=None, support_lps=None) -> dict[str, Any] | None:
        """One output batch for this request; returns the chunk dict (None: non-streaming, running).

        ``support[t]``: the kept token ids at token ``t``; ``support_lps[t]``: their renormalised
        log-probs (only with ``sampling_mode``)."""
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": finish, "prompt_tokens": 4,
                                "weight_version": "default", "num_retractions": 0}
        self.output_token_logprobs.extend((lp, t, None) for lp, t in zip(lps, ids))
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = self.output_token_logprobs
        meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
        if self.sampling_mode is not None:
            for t, tok in enumerate(ids):
                self.sampling_mask.append(list(support[t]))
                if self.sampling_mode == "selected":
                    self.sampling_logprobs.append(support_lps[t][list(support[t]).index(tok)])
                else:
                    self.sampling_logprobs.append(list(support_lps[t]))
            meta["output_token_sampling_mask"] = self.sampling_mask
            meta["output_token_sampling_logprobs"] = self.sampling_logprobs
            meta["output_token_sampling_mask_length"] = len(self.sampling_mask)
        meta.update(reasoning_tokens=0, completion_tokens=len(self.output_ids) + len(ids), cached_tokens=0)
        delta_text = "".join(f"<{t}>" for t in ids)
        offset = self.last_output_offset
        self.text += delta_text
        self.output_ids.extend(ids)
        finished = finish is not None
        if not self.stream:
            return {"text": self.text, "output_ids": self.output_ids.copy(), "meta_info": meta} if finished else None
        if self.incremental:
            for key in ("output_token_logprobs", "output_token_sampling_mask", "output_token_sampling_logprobs"):
                if key in meta:
                    meta[key] = meta[key][offset:]
            self.last_output_offset = len(self.output_ids)
            return {"text": delta_text, "output_ids": list(ids), "meta_info": meta}
        if finished:
            return {"text": self.text, "output_ids": self.output_ids.copy(), "meta_info": meta}
        return {"text": None, "output_ids": self.output_ids, "meta_info": meta}

    def abort_in_queue(self, message: str = "Abort in waiting queue") -> dict[str, Any]:
        """The one chunk ``_handle_abort_req`` hands out when the request is aborted in the waiting queue."""
        meta: dict[str, Any] = {"id": self.rid, "finish_reason": {"type": "abort", "message": message},
                                "weight_version": "default", "e2e_latency": 0.5}
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = self.output_token_logprobs
        meta["output_token_logprobs_length"] = len(self.output_token_logprobs)
        meta["completion_tokens"] = len(self.output_ids)
        ids = self.output_ids
        if self.stream:
            ids = [ids[-1]] if ids else []
        return {"text": self.text, "output_ids": ids, "meta_info": meta}

    def drain(self, out: dict[str, Any], index: int | None = None) -> str:
        """``_stream_one_response`` (+ ``_stream_batch_responses``) then the HTTP server: the SSE line
        of ``out`` serialised *now* (referenced lists as they are now)."""
        if out.get("text") is None and not self.incremental:
            out["text"] = self.text
        if index is not None:
            out["index"] = index
        return sse_line(out)
