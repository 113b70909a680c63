"""The megatron-core hook's side of the sampling-support replay: a ``TISBatch`` carries the supports (CP-local
CSR), ``--tis-sampling-support`` picks the pass (default: replay where the batch carries a support), and the
fused output layer refuses a support it cannot replay. One process, no megatron initialisation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_support_logprobs import TAU, T, V, make_case

from slime_tis import TISConfig
from slime_tis.engine.batch import TISBatch, cp_slice_padded
from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
from slime_tis.engine.settings import LogProbSettings
from slime_tis.engine.support_logprobs import padded_support, select_rows
from slime_tis.megatron.recompute import logits_to_log_probs, output_to_log_probs


def _batch(with_support: bool = True):
    logits, targets, ids, offsets, _ = make_case(7)
    b = TISBatch.from_padded(targets.view(1, T), torch.ones(1, T, dtype=torch.bool), torch.ones(1, T),
                             torch.zeros(1, T), cp_slice=False)
    if with_support:
        b = dataclasses.replace(b, support_ids=ids, support_offsets=offsets)
    return logits, b


@pytest.mark.parametrize("mode", [None, "replay", "full"])
def test_the_flag_picks_the_pass(mode):
    logits, batch = _batch()
    settings = LogProbSettings(temperature=TAU, sampling_support=mode)
    lp, _ = logits_to_log_probs(logits, batch, settings, with_entropy=False)
    support = None if mode == "full" else (batch.support_ids, batch.support_offsets)
    ref, _ = vocab_parallel_log_probs_and_entropy(logits, batch.labels, temperature=TAU, tp_group=None,
                                                  row_mask=batch.loss_mask, support=support, with_entropy=False)
    assert torch.equal(lp, ref)
    if mode != "full":  # the replay differs from the full pass wherever the support is not the whole vocabulary
        full, _ = vocab_parallel_log_probs_and_entropy(logits, batch.labels, temperature=TAU, tp_group=None)
        assert (lp - full).abs().max() > 1e-3


def test_replay_without_a_support_is_refused():
    logits, plain = _batch(with_support=False)
    with pytest.raises(ValueError, match="--tis-sampling-support replay .* carries no support"):
        logits_to_log_probs(logits, plain, LogProbSettings(sampling_support="replay"), with_entropy=False)
    lp, _ = logits_to_log_probs(logits, plain, LogProbSettings(), with_entropy=False)   # default: full
    assert torch.isfinite(lp).all()
    _, batch = _batch()
    with pytest.raises(ValueError, match="needs the model chunk"):   # fused: the support goes to fused_log_probs
        output_to_log_probs(torch.zeros(1, T, 4), batch, LogProbSettings(output_layer="fused"), with_entropy=False)


def test_config_flag_and_settings_validation():
    assert TISConfig().sampling_support is None
    assert TISConfig(sampling_support="full").sampling_support == "full"
    with pytest.raises(ValueError, match="sampling_support"):
        TISConfig(sampling_support="top_p")
    with pytest.raises(ValueError, match=r"sampling_support must be one of \('full', 'replay'\) or None, got 'x'"):
        LogProbSettings(sampling_support="x")
    _, batch = _batch()
    with pytest.raises(ValueError, match="support_ids and support_offsets are given together"):
        dataclasses.replace(batch, support_offsets=None)
    with pytest.raises(ValueError, match=f"support_offsets has {T} entries"):
        dataclasses.replace(batch, support_offsets=batch.support_offsets[:-1])


def test_padded_support_follows_the_context_parallel_slice():
    b, s = 2, 8
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 4, (b * s,), generator=g)
    offsets = torch.zeros(b * s + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    ids = torch.randint(0, V, (int(offsets[-1]),), generator=g, dtype=torch.int32)
    rows = [ids[offsets[p]:offsets[p + 1]].tolist() for p in range(b * s)]
    assert padded_support(ids, offsets, (b, s), cp_slice=True, cp_size=1, cp_rank=0)[1] is not None
    for rank in range(2):
        got_ids, got_off = padded_support(ids, offsets, (b, s), cp_slice=True, cp_size=2, cp_rank=rank)
        kept = cp_slice_padded(torch.arange(b * s).view(b, s), 2, rank).reshape(-1).tolist()
        assert got_off.numel() == len(kept) + 1
        assert [got_ids[got_off[i]:got_off[i + 1]].tolist() for i in range(len(kept))] == [rows[p] for p in kept]
    sel_ids, sel_off = select_rows(ids, offsets, torch.tensor([3, 0, 3]))
    assert [sel_ids[sel_off[i]:sel_off[i + 1]].tolist() for i in range(3)] == [rows[3], rows[0], rows[3]]


def test_fused_output_layer_replays_the_support():
    """``output_to_log_probs`` in fused mode hands the batch's support to ``fused_log_probs``: the log-probs of
    ``h W^T`` over each position's support (a stand-in GPTModel: untied output layer switched to fused mode)."""
    from types import SimpleNamespace

    from slime_tis.megatron.output_layer import _MODE_ATTR

    _, batch = _batch()
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(1, T, 8, generator=g), torch.randn(V, 8, generator=g)
    layer = SimpleNamespace(weight=weight, tp_group=None, **{_MODE_ATTR: "fused"})
    model = SimpleNamespace(output_layer=layer, share_embeddings_and_output_weights=False, post_process=True)
    settings = LogProbSettings(temperature=TAU, output_layer="fused")
    lp, _ = output_to_log_probs(hidden, batch, settings, model_chunk=model, with_entropy=False)
    logits = hidden.reshape(T, 8) @ weight.t()
    ref, _ = vocab_parallel_log_probs_and_entropy(logits, batch.labels, temperature=TAU, tp_group=None,
                                                  row_mask=batch.loss_mask, support=(batch.support_ids,
                                                                                     batch.support_offsets))
    assert (lp - ref).abs().max() < 2e-5
    full, _ = output_to_log_probs(hidden, batch, LogProbSettings(temperature=TAU, output_layer="fused",
                                                                 sampling_support="full"),
                                  model_chunk=model, with_entropy=False)
    assert (full - lp).abs().max() > 1e-3
