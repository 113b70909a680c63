"""The host where Megatron-LM prepares the update (``slime_tis.megatron_rl.rollout``), on the stand-in of
``rl_utils.prepare_data_for_update`` (``tests/_megatron_rl.py``, commit d98e8a64dd) and a bigram model.

* forward passes per rollout: pi_old only for algorithms 0 and 2, pi_ref only with the KL term (Megatron-LM runs
  both always);
* under ``--bf16`` pi_old is the host's float32 log-prob: equal policies give weights of exactly 1 at log-prob
  -9.1 (Megatron-LM's bf16 pi_old gives 0.975);
* algorithm 2's batch normalisation over the whole rollout collection, decided once per rollout: two optimizer
  steps on one collection use the same factor, the collection's, and each step's loss is the core's with it;
* interleaved pipeline schedules and context parallelism are refused in one line;
* under algorithms 1-3 a sequence one inference log-prob short at its last generated token (the end-of-document
  token the training side appends) trains on its other tokens, that token left out of the loss and counted
  (``tis/appended_tokens``); a sequence whose inference log-probs are missing or of any other length is rejected
  as non-finite and counted (``tis/nonfinite_seq_fraction``); rollouts without any are refused in one line.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from _megatron_lm import train_step_loss_reduced
from _megatron_rl import RLArgs, RLUtils

from slime_tis import TISConfig
from slime_tis.core import compute_tis, policy_loss
from slime_tis.megatron_rl import RLHost, add_megatron_rl_tis_arguments
from slime_tis.megatron_rl.__main__ import megatron_rl_reader
from slime_tis.megatron_rl.host import APPENDED_METRIC, RolloutIndex
from slime_tis.megatron_rl.rollout import check_inference_log_probs, final_turns, install_rollout

VOCAB, ROWS, COLS = 13, 8, 10


class Bigram(torch.nn.Module):
    def __init__(self, seed: int = 0, w: torch.Tensor | None = None):
        super().__init__()
        w = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) if w is None else w
        self.w = torch.nn.Parameter(w.clone())
        self.calls = 0

    def forward(self, tokens, position_ids=None, attention_mask=None, **kw):
        self.calls += 1
        return self.w[tokens]


def _rollout(seed: int, model: Bigram, temperature: float = 1.0, noise: float = 0.4) -> dict:
    """Rows of a prompt and a generated response; the inference log-probs are the model's at ``temperature``
    plus ``noise`` (0: equal policies)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (ROWS, COLS), generator=g)
    lengths = [int(x) for x in torch.randint(6, COLS + 1, (ROWS,), generator=g)]
    prompt = [int(x) for x in torch.randint(1, 4, (ROWS,), generator=g)]
    gen = torch.zeros(ROWS, COLS, dtype=torch.bool)
    for r, (p, n) in enumerate(zip(prompt, lengths)):
        tokens[r, n:] = 0
        gen[r, p:n] = True
    with torch.no_grad():
        lp = torch.log_softmax(model(tokens)[:, :-1].float() / temperature, -1)
        lp = lp.gather(-1, tokens[:, 1:, None]).squeeze(-1)
    model.calls = 0
    inference = [lp[r, p - 1:n - 1] + noise * torch.randn(n - p, generator=g) for r, (p, n) in
                 enumerate(zip(prompt, lengths))]
    return dict(tokens=tokens, gen_mask=gen, lengths=lengths, inference=inference,
                advantages=torch.randn(ROWS, generator=g), prompt=prompt)


def _args(argv: list[str], **kw):
    parser = argparse.ArgumentParser()
    add_megatron_rl_tis_arguments(parser)
    ns = parser.parse_args(argv)
    base = dict(RLArgs().__dict__, grpo_kl_beta=0.0, rl_inference_logprobs_is_correction=False)
    for k, v in {**base, **kw}.items():
        setattr(ns, k, v)
    return ns


def _prepared(ns, m: int, rollout: dict, model: Bigram):
    """The launcher's wiring on the stand-in: ``(host, rl_utils, hooks, training iterator)``; micro-batches of
    2 rows, or one bin (Megatron-LM's packed loader takes one bin a micro-batch)."""
    rl = RLUtils(ns, micro_batch_size=1 if ns.rl_use_sequence_packing else 2)
    host = RLHost.from_args(ns, m, on_sequences=rl.state.increment_sequences)
    hooks = install_rollout(rl, lambda: host, megatron_rl_reader(ns, rl), lambda: ns)
    ref = {k: v + 0.1 for k, v in model.state_dict().items()}
    it, _, _ = rl.prepare_data_for_update(model, ref, rollout, ns.rl_use_sequence_packing,
                                          ns.rl_inference_logprobs_is_correction)
    return host, rl, hooks, it


ALGORITHMS = {0: [], 1: ["--use-rollout-log-probs"], 2: ["--use-tis"], 3: ["--use-tis", "--use-rollout-log-probs"]}


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("kl", [0.0, 0.05], ids=["no-kl", "kl"])
@pytest.mark.parametrize("algorithm", [0, 1, 2, 3])
def test_forward_passes_per_rollout(algorithm: int, kl: float, packed: bool) -> None:
    """Megatron-LM runs a pi_old and a pi_ref pass over the collection (one forward per log-prob loader batch
    each); the host runs pi_old only for algorithms 0 and 2 and pi_ref only with the KL term. The training steps
    after it still see every micro-batch once per pass over the collection."""
    model = Bigram()
    rollout = _rollout(1, model)
    ns = _args(ALGORITHMS[algorithm], grpo_kl_beta=kl, rl_use_sequence_packing=packed)
    host, rl, hooks, it = _prepared(ns, 1, rollout, model)
    batches = len(rl.state.packing_context.packed_trajs) if packed else ROWS // 2
    passes = int(algorithm in (0, 2)) + int(kl != 0.0)
    assert model.calls == passes * batches, (model.calls, passes, batches)
    assert hooks.forwards["old"] == int(algorithm in (0, 2)) and hooks.forwards["ref"] == int(kl != 0.0)
    assert hooks.skipped["old"] + hooks.skipped["ref"] == 2 - passes
    for batch, *_ in host._rollout:   # algorithms 1-3 anchor on the inference log-probs: Megatron-LM kept them
        kept = batch.loss_mask != 0
        assert (batch.rollout_log_probs is None) == (algorithm == 0)
        assert algorithm == 0 or bool((batch.rollout_log_probs[kept] < 0).all())
    k = len(host._rollout)
    for _ in range(k):
        output, loss_func = host.forward_step(it, model)
        loss_func(output)
    assert model.calls == passes * batches + k
    assert rl.state.sequences == ROWS


def _weights_at(lp_target: float, temperature: float) -> torch.Tensor:
    """A bigram table under which every token 1..V-1 has log-prob ``lp_target`` at ``temperature`` (token 0 takes
    the rest): ``log p = -log(exp(w0 / T) + V - 1)``."""
    w = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    w[:, 0] = temperature * torch.log(torch.exp(torch.tensor(-lp_target, dtype=torch.float64)) - (VOCAB - 1))
    return w.float()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_bf16_pi_old_is_the_hosts_float32_weights_exactly_one(packed: bool) -> None:
    """Under ``--bf16``, inference log-probs = the policy's (float32, at T = 0.8) at log-prob ~-9.1: every weight
    of algorithm 2 is exactly 1 and pi_old is float32. Control: Megatron-LM's own pi_old (the stand-in without the
    host's passes) is bf16 and untempered, and its weight at the same tokens is not 1."""
    model = Bigram(w=_weights_at(-9.1, 0.8))
    rollout = _rollout(2, model, temperature=0.8, noise=0.0)
    assert all(abs(float(x.mean()) + 9.1) < 0.05 for x in rollout["inference"])
    ns = _args(["--use-tis", "--tis-upper-bound", "2.0"], bf16=True, rl_use_sequence_packing=packed,
               rl_default_temperature=0.8)
    host, rl, hooks, it = _prepared(ns, 4, rollout, model)
    assert hooks.forwards["old"] == 1
    n = 0
    for batch, *_ in host._rollout:
        assert batch.old_log_probs.dtype == torch.float32
        kept = batch.loss_mask != 0
        n += int(kept.sum())
        res = compute_tis(host.cfg, batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask,
                          batch.cu_seqlens)
        assert torch.equal(res.weights[kept], torch.ones(int(kept.sum()))), res.weights[kept]
    assert n >= 30

    own = RLUtils(ns, micro_batch_size=1 if packed else 2)  # Megatron-LM's own passes: bf16, no temperature
    it, _, _ = own.prepare_data_for_update(model, model.state_dict(), rollout, packed, True)
    item = megatron_rl_reader(ns, own)(next(it))
    old, mask = item[2], (item[3] if packed else item[3][:, 1:])
    inf = item[6]
    assert old.dtype == torch.bfloat16
    w = torch.exp(old.float() - inf)[mask.bool()]
    assert (w - 1).abs().max() > 0.01


def test_batch_normalisation_over_the_rollout_collection_decided_once(monkeypatch) -> None:
    """Algorithm 2 with batch normalisation, 4 micro-batches a collection, 2 a step: both optimizer steps use one
    factor, the collection's ``count / sum of weights`` (the core's ``compute_tis`` on the whole collection),
    which differs from each step's own; each step's loss equals the core's ``policy_loss`` on the step's rows with
    that factor; no correction runs again after the collection was decided. Tolerance: float32 sums."""
    import slime_tis.engine.totals as totals_mod

    calls = {"n": 0}
    real = totals_mod.compute_tis

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(totals_mod, "compute_tis", counted)
    model = Bigram()
    rollout = _rollout(3, model, noise=0.6)
    ns = _args(["--use-tis", "--tis-upper-bound", "1.6", "--tis-batch-normalize", "--tis-level", "sequence"])
    host, rl, hooks, it = _prepared(ns, 2, rollout, model)
    assert len(host._rollout) == 4 and calls["n"] == 4
    cfg = host.cfg
    cat = {k: torch.cat([getattr(b, k) for b, *_ in host._rollout]) for k in
           ("old_log_probs", "rollout_log_probs", "loss_mask", "advantages", "labels")}
    cu = torch.arange(ROWS + 1) * (COLS - 1)
    whole = compute_tis(cfg, cat["old_log_probs"], cat["rollout_log_probs"], cat["loss_mask"], cu)
    f = whole.norm_count / whole.norm_sum
    torch.testing.assert_close(host.rollout_factor, f, rtol=2e-7, atol=0)
    for step in range(2):
        rows = slice(4 * step * (COLS - 1), 4 * (step + 1) * (COLS - 1))
        own = compute_tis(cfg, cat["old_log_probs"][rows], cat["rollout_log_probs"][rows], cat["loss_mask"][rows],
                          cu[:5])
        assert abs(float(own.norm_count / own.norm_sum) - float(f)) > 1e-3   # the step's own factor differs
        model.zero_grad()
        total = torch.zeros(())
        for _ in range(2):
            output, loss_func = host.forward_step(it, model)
            total = total + loss_func(output)[0] / 2
        assert host.engine.totals.batch_norm_factor is host.rollout_factor
        d_tokens = rollout["tokens"][4 * step:4 * step + 4]
        lp = torch.log_softmax(model(d_tokens)[:, :-1].float(), -1).gather(-1, d_tokens[:, 1:, None]).reshape(-1)
        want = policy_loss(cfg, lp, cat["old_log_probs"][rows], cat["rollout_log_probs"][rows],
                           cat["advantages"][rows], cat["loss_mask"][rows], cu[:5], batch_norm_factor=f)
        tol = 64 * torch.finfo(torch.float32).eps * max(1.0, abs(float(want.loss)))
        assert abs(float(total) - float(want.loss)) <= tol, (float(total), float(want.loss))
    assert calls["n"] == 8       # the collection's factor once, then each step's totals (its drop denominator)
    assert isinstance(next(it), RolloutIndex)


@pytest.mark.parametrize("argv_attr,value,flag", [
    ("num_layers_per_virtual_pipeline_stage", 2, "--num-layers-per-virtual-pipeline-stage 2"),
    ("num_virtual_stages_per_pipeline_rank", 3, "--num-virtual-stages-per-pipeline-rank 3"),
    ("virtual_pipeline_model_parallel_size", 2, "--virtual-pipeline-model-parallel-size 2"),
])
def test_interleaved_pipeline_is_refused_in_one_line(argv_attr: str, value: int, flag: str) -> None:
    ns = _args(["--use-tis", "--tis-upper-bound", "2.0"], **{argv_attr: value})
    with pytest.raises(ValueError, match=flag) as e:
        RLHost.from_args(ns, 2)
    assert "\n" not in str(e.value)
    RLHost.from_args(_args(["--use-tis", "--tis-upper-bound", "2.0"], virtual_pipeline_model_parallel_size=None), 2)
    host = RLHost(TISConfig(use_tis=True), 1)
    with pytest.raises(ValueError, match="2 virtual pipeline stages") as e:
        host.forward_step(iter([]), [Bigram(), Bigram()])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cp,packed", [(2, True), (4, True), (2, False), (1, True), (None, True)])
def test_context_parallelism_with_packed_bins_is_refused_at_start_up_in_one_line(cp, packed: bool) -> None:
    """The host splits unpacked rows across context-parallel ranks (``cp_slice_padded``; on Megatron-LM's tree:
    tests/dist/test_megatron_rl_real_tree.py), not packed bins: a context-parallel size above 1 with
    ``--rl-use-sequence-packing`` is refused when the host is built from Megatron-LM's arguments, in one line naming
    both flags and what to use instead (under a real CP=2 layout ``begin_rollout`` and ``forward_step`` refuse
    packed bins too: tests/dist/test_megatron_rl_dist.py)."""
    ns = _args(["--use-tis", "--tis-upper-bound", "2.0"], context_parallel_size=cp, rl_use_sequence_packing=packed)
    if not (packed and cp and cp > 1):
        RLHost.from_args(ns, 2)
        return
    with pytest.raises(ValueError, match=f"^--context-parallel-size {cp} with --rl-use-sequence-packing: .*"
                                         "--context-parallel-size 1$") as e:
        RLHost.from_args(ns, 2)
    assert "\n" not in str(e.value)


def _bad_rows(rollout: dict) -> dict:
    """Row 1 lacks its last two log-probs, row 4 carries none, row 6 one too many; the other rows carry one per
    generated token."""
    inference = list(rollout["inference"])
    inference[1] = inference[1][:-2]
    inference[4] = torch.zeros(0)
    inference[6] = torch.cat([inference[6], torch.tensor([-1.0])])
    return {**rollout, "inference": inference}


BAD = (1, 4, 6)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("algorithm", [1, 2, 3])
def test_a_sequence_with_missing_or_misaligned_inference_log_probs_is_rejected_and_counted(algorithm, packed):
    """Algorithms 1-3 read the inference log-probs: a sequence whose count of them differs from its generated
    tokens (Megatron-LM would anchor the unreported slots on 0, or on pi_old) is rejected as a whole as
    non-finite: its inference log-probs reach the host as -inf on every valid token, the step's
    ``tis/nonfinite_seq_fraction`` is 3/8, the loss and gradient are finite and the rejected rows' advantages do
    not move the gradient (changed by 5 below: same gradient, exactly). The other rows keep the rollout's
    log-probs."""
    model = Bigram()
    rollout = _bad_rows(_rollout(4, model, noise=0.3))
    argv = ALGORITHMS[algorithm] + (["--tis-upper-bound", "2.0"] if algorithm != 1 else [])

    def step(advantages):
        ns = _args(argv, rl_use_sequence_packing=packed)
        host, rl, hooks, it = _prepared(ns, 1, {**rollout, "advantages": advantages}, model)
        k = len(host._rollout)
        host._m = lambda: k
        model.zero_grad()
        total = torch.zeros(())
        for _ in range(k):
            output, loss_func = host.forward_step(it, model)
            total = total + loss_func(output)[0] / k
        total.backward()
        return host, hooks, total, model.w.grad.clone()

    host, hooks, total, grad = step(rollout["advantages"])
    assert float(host.metrics["tis/nonfinite_seq_fraction"]) == pytest.approx(3 / 8, abs=1e-7)
    assert dict(hooks.rejected) == {"length": 2, "missing": 1} and hooks.appended == 0
    assert torch.isfinite(total) and bool(torch.isfinite(grad).all()) and float(grad.abs().sum()) > 0
    seen = set()
    for batch, _tokens, _, b, _ in host._rollout:
        rows = b.seq_indices if packed else None
        for s in range(len(batch.cu_seqlens) - 1):
            span = slice(int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1]))
            valid = batch.loss_mask[span] != 0
            lp = batch.rollout_log_probs[span][valid]
            if not valid.any():
                continue
            row = rows[s] if packed else None
            if row is None:   # unpacked: find the row by its tokens
                row = next(r for r in range(ROWS) if torch.equal(rollout["tokens"][r, 1:], batch.labels[span]))
            seen.add(row)
            if row in BAD:
                assert bool(torch.isneginf(lp).all()), (row, lp)
            else:
                assert bool(torch.isfinite(lp).all()) and torch.equal(lp, rollout["inference"][row].float())
    assert seen == set(range(ROWS))
    moved = rollout["advantages"].clone()
    moved[list(BAD)] += 5.0
    _, _, total2, grad2 = step(moved)
    assert torch.equal(grad2, grad) and float(total2) == float(total)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("algorithm", [1, 2, 3])
def test_rollouts_without_inference_log_probs_are_refused_in_one_line(algorithm, packed):
    """No sequence carries an inference log-prob while the algorithm reads them: refused in one line where
    Megatron-LM prepares the update (before any log-prob pass), naming the flag and the algorithm. Algorithm 0
    does not read them: the same rollouts train, nothing marked."""
    model = Bigram()
    rollout = {**_rollout(5, model), "inference": [None] * ROWS}
    ns = _args(ALGORITHMS[algorithm] + (["--tis-upper-bound", "2.0"] if algorithm != 1 else []),
               rl_use_sequence_packing=packed)
    flag = {1: "--use-rollout-log-probs", 2: "--use-tis", 3: "--use-tis --use-rollout-log-probs"}[algorithm]
    with pytest.raises(ValueError, match=f"^{flag} \\(algorithm {algorithm}\\) reads the inference log-probs") as e:
        _prepared(ns, 1, rollout, model)
    assert "\n" not in str(e.value) and "8 sequences" in str(e.value)
    assert model.calls == 0
    host, _, hooks, it = _prepared(_args([], rl_use_sequence_packing=packed), 1, rollout, model)
    assert not hooks.rejected and host.cfg.algorithm == 0


SHORT = (1, 5)   # rows one inference log-prob short at their last generated token; row 6 is two short


def _short_rows(rollout: dict) -> dict:
    inference = list(rollout["inference"])
    for r in SHORT:
        inference[r] = inference[r][:-1]
    inference[6] = inference[6][:-2]
    return {**rollout, "inference": inference}


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("algorithm", [1, 2, 3])
def test_a_sequence_short_by_one_at_its_end_trains_on_its_other_tokens(algorithm, packed):
    """Megatron-LM appends an end-of-document token on the training side that the inference engine never sampled
    (a rollout's final turn may be one log-prob short). Rows 1 and 5 lack their last inference log-prob, row 6 its
    last two: rows 1 and 5 train on every other generated token, with that one token out of the loss; row 6 is
    rejected. The step's loss and gradient equal the core's ``policy_loss`` over the collection's unpacked rows
    with the two appended tokens masked out and row 6's inference log-probs ``-inf`` (float32 sums over a
    different order and log-softmax over a different batch shape: 64 eps relative on the loss, 1e-6 on the
    gradient); the appended tokens are counted (2, also through ``train_step``'s reduction of the loss dicts) and
    row 6 in ``tis/nonfinite_seq_fraction`` (1/8). Control: the core's loss with the appended tokens kept differs."""
    model = Bigram()
    base = _rollout(4, model, noise=0.3)
    rollout = _short_rows(base)
    ns = _args(ALGORITHMS[algorithm] + (["--tis-upper-bound", "2.0"] if algorithm != 1 else []),
               rl_use_sequence_packing=packed)
    host, rl, hooks, it = _prepared(ns, 1, rollout, model)
    k = len(host._rollout)
    host._m = lambda: k
    model.zero_grad()
    total, dicts = torch.zeros(()), []
    for _ in range(k):
        output, loss_func = host.forward_step(it, model)
        ret = loss_func(output)
        total = total + ret[0] / k
        dicts.append(ret[-1])
    total.backward()
    grad = model.w.grad.clone()
    assert hooks.appended == 2 and host.appended == 2 and dict(hooks.rejected) == {"length": 1}
    assert float(train_step_loss_reduced(dicts)[APPENDED_METRIC]) == 2.0
    assert float(host.metrics["tis/nonfinite_seq_fraction"]) == pytest.approx(1 / 8, abs=1e-7)

    tokens, t = rollout["tokens"], COLS - 1
    mask, lp_inf = rollout["gen_mask"][:, 1:].float(), torch.zeros(ROWS, t)
    for r, (p, n) in enumerate(zip(base["prompt"], base["lengths"])):
        lp_inf[r, p - 1:n - 1] = base["inference"][r]   # token at position q: slot q - 1
    lp_inf[6, mask[6] != 0] = float("-inf")
    kept = mask.clone()
    for r in SHORT:
        assert mask[r, base["lengths"][r] - 2] == 1
        mask[r, base["lengths"][r] - 2] = 0.0   # the last generated token, position n - 1
    model.zero_grad()
    lp, _ = host.log_probs(model(tokens), tokens[:, 1:].reshape(-1))
    adv = rollout["advantages"].reshape(-1, 1).expand(ROWS, t).reshape(-1)
    cu = torch.arange(ROWS + 1) * t
    old = lp.detach() if host.cfg.needs_old_log_probs else None

    def core(m):
        return policy_loss(host.cfg, lp, old, lp_inf.reshape(-1), adv, m.reshape(-1), cu).loss

    want = core(mask)
    want.backward()
    tol = 64 * torch.finfo(torch.float32).eps * max(1.0, abs(float(want)))
    assert abs(float(total) - float(want)) <= tol, (float(total), float(want))
    torch.testing.assert_close(grad, model.w.grad, rtol=0, atol=1e-6)
    assert abs(float(core(kept).detach()) - float(want)) > 100 * tol   # control: the appended tokens kept
    assert sum(int((b.loss_mask != 0).sum()) for b, *_ in host._rollout) == int(mask.sum())   # the host's mask


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_algorithm_0_trains_the_appended_token(packed):
    """Algorithm 0 reads no inference log-probs: the same rollouts are not checked, every generated token trains,
    nothing is counted and no appended-token metric is logged."""
    model = Bigram()
    rollout = _short_rows(_rollout(4, model, noise=0.3))
    host, _, hooks, it = _prepared(_args([], rl_use_sequence_packing=packed), 1, rollout, model)
    assert hooks.appended == 0 and not hooks.rejected and host.appended is None
    assert sum(int((b.loss_mask != 0).sum()) for b, *_ in host._rollout) == int(rollout["gen_mask"][:, 1:].sum())
    k = len(host._rollout)
    host._m = lambda: k
    dicts = []
    for _ in range(k):
        output, loss_func = host.forward_step(it, model)
        dicts.append(loss_func(output)[-1])
    assert APPENDED_METRIC not in dicts[0]


def test_only_a_final_turn_one_short_at_its_end_drops_its_last_token():
    """``check_inference_log_probs`` on Megatron-LM's rows: a row one short ending its rollout (a whole rollout,
    or the last turn of one trained turn by turn) has its last generated token cleared from a new generation mask
    (the argument is left as it was) and keeps its log-probs; one short ending a non-final turn, two short, one
    too many, or one short with none at all (a single generated token) is rejected (``-inf`` on every generated
    token)."""
    chain = types.SimpleNamespace(trajectory=[[1, 2], [1, 2, 3]])   # a rollout trained one row per turn
    whole = types.SimpleNamespace(trajectory=[[1, 2, 3]])
    rows = [whole, (chain, 1), (chain, 0), whole, whole, whole, None]
    gen = torch.zeros(7, 8, dtype=torch.bool)
    gen[:, 2:6] = True
    gen[5] = False
    gen[5, 3] = True            # one generated token
    gen[6] = False              # a padding row
    lps = [torch.full((3,), -0.5), torch.full((3,), -0.5), torch.full((3,), -0.5), torch.full((2,), -0.5),
           torch.full((5,), -0.5), None, None]
    before = gen.clone()
    final = final_turns(rows, 7)
    assert final == [True, True, False, True, True, True, True]
    cfg = TISConfig(use_tis=True, upper=2.0)
    masks, out, counts = check_inference_log_probs(gen, lps, cfg, final_turn=final)
    assert torch.equal(gen, before) and masks is not gen
    assert dict(counts) == {"appended": 2, "length": 3, "missing": 1}
    for r in (0, 1):
        assert masks[r].nonzero().flatten().tolist() == [2, 3, 4] and torch.equal(out[r], lps[r])
    for r in (2, 3, 4, 5):
        assert torch.equal(masks[r], gen[r]) and bool(torch.isneginf(out[r]).all())
        assert out[r].numel() == int(gen[r].sum())
    assert out[6] is None and not masks[6].any()
    assert final_turns({"tokens": gen}, 7) is None and final_turns(rows, 6) is None
    same, _, counts = check_inference_log_probs(gen, [torch.zeros(4)] * 5 + [torch.zeros(1), None], cfg)
    assert same is gen and not counts
