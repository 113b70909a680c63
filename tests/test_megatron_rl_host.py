"""The host for Megatron-LM's ``train_rl.py`` (``slime_tis.megatron_rl``) on Megatron-LM RL micro-batches.

The items are the stand-in's (``tests/_megatron_rl.py``, commit d98e8a64dd): unpacked 7-tuples and packed bins.
The model is a bigram table (``logits[b, t] = W[tokens[b, t]]``: its log-probs do not depend on the layout or the
micro-batch split), so Megatron-LM's loop, the host and the core see the same log-probs.

* algorithm 2, token level, truncate mode through the host = ``train_rl.forward_step`` / ``calculate_grpo_loss``
  (KL and entropy terms) on the same batch: loss and gradient;
* every algorithm / level / mode / rule / denominator through the host, split in micro-batches = one core
  ``policy_loss`` on the whole batch (loss, gradient);
* packed bins = unpacked rows; the ``tis/*`` metrics reach Megatron-LM's ``train_step`` reduction;
* the three defects do not occur: float32 weights exactly 1 at log-prob -9, the temperature applied, no
  untruncated weight (refused) and a finite loss for a 100-nat log-ratio;
* Megatron-LM's flags map onto the plugin's, conflicts are refused in one line; the launcher binds the host's
  ``forward_step`` and the plugin's flags into ``pretrain``.
"""

from __future__ import annotations

import argparse
import types

import pytest
import torch
from _megatron_lm import train_step_loss_reduced
from _megatron_rl import RLArgs, forward_step, pack_bins, scheduled_loss

from slime_tis import TISConfig
from slime_tis.core import LocalReducer, policy_loss
from slime_tis.engine.parallel import ParallelContext
from slime_tis.megatron_rl import RLHost, add_megatron_rl_tis_arguments, config_from_megatron_rl_args
from slime_tis.megatron_rl.__main__ import install
from slime_tis.megatron_rl.host import item_to_batch

EPS32 = torch.finfo(torch.float32).eps
VOCAB, ROWS, COLS = 13, 6, 10


class Bigram(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)))

    def forward(self, tokens, position_ids=None, attention_mask=None, packed_seq_params=None):
        self.seen = (attention_mask, packed_seq_params)
        return self.w[tokens]                                   # [B, S, V]


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (ROWS, COLS), generator=g)
    prompt = torch.randint(1, 4, (ROWS,), generator=g)
    length = torch.randint(6, COLS + 1, (ROWS,), generator=g)
    col = torch.arange(COLS)[None]
    mask = ((col >= prompt[:, None]) & (col < length[:, None])).float()
    mask *= (torch.rand(ROWS, COLS, generator=g) > 0.15).float()
    for r, n in enumerate(length.tolist()):
        tokens[r, n:] = 0
    with torch.no_grad():
        lp = torch.log_softmax(Bigram()(tokens)[:, :-1], -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    inf = lp + 0.5 * torch.randn(ROWS, COLS - 1, generator=g)
    old = lp + 0.3 * torch.randn(ROWS, COLS - 1, generator=g)
    ref = lp + 0.2 * torch.randn(ROWS, COLS - 1, generator=g)
    return dict(tokens=tokens, mask=mask, inf=inf, old=old, ref=ref, adv=torch.randn(ROWS, generator=g),
                length=length, pos=torch.arange(COLS).expand(ROWS, COLS))


def _unpacked_items(d, m: int):
    rows = torch.arange(ROWS).chunk(m)
    return [(d["tokens"][r], d["adv"][r], d["old"][r], d["mask"][r], d["pos"][r], d["ref"][r], d["inf"][r])
            for r in rows]


def _packed_items(d):
    lengths = [int(x) for x in d["length"]]
    items = []
    for b in pack_bins(d["tokens"], lengths, d["mask"].bool(), bin_size=16, max_per_bin=3):
        grids = {k: torch.zeros(1, 15) for k in ("old", "ref", "inf")}
        for i, start in zip(b.seq_indices, b.seq_starts):
            for k in grids:
                grids[k][0, start:start + lengths[i] - 1] = d[k][i, :lengths[i] - 1]
        items.append((b, d["adv"][b.seq_indices], grids["old"], grids["ref"], grids["inf"]))
    return items


def _run_host(host: RLHost, items, model: Bigram):
    """One optimizer step through the host as megatron-core's no-pipelining schedule drives it: forward_step, then
    loss_func, per micro-batch; the returned losses backpropagated. Returns (summed loss, grad, dicts)."""
    it, total, dicts = iter(items), torch.zeros(()), []
    for _ in items:
        output, loss_func = host.forward_step(it, model)
        ret = loss_func(output)
        loss = ret[0] if host.per_token else ret[0] / len(items)   # what the schedule backpropagates
        total = total + loss
        dicts.append(ret[-1])
    total.backward()
    return total.detach(), model.w.grad.clone(), dicts


def _core(cfg: TISConfig, d, temperature: float = 1.0, sampled_entropy: bool = False):
    """The core on the whole batch, rows as sequences, positions t < S-1 (no host, no schedule)."""
    model = Bigram()
    logits = model(d["tokens"])[:, :-1] / temperature
    logp = torch.log_softmax(logits, -1)
    lp = logp.gather(-1, d["tokens"][:, 1:, None]).squeeze(-1).reshape(-1)
    h = -(logp.exp() * logp).sum(-1).reshape(-1)
    n = COLS - 1
    out = policy_loss(cfg, lp, d["old"].reshape(-1) if cfg.needs_old_log_probs else None,
                      d["inf"].reshape(-1) if cfg.algorithm else None,
                      d["adv"][:, None].expand(ROWS, n).reshape(-1), d["mask"][:, 1:].reshape(-1),
                      torch.arange(ROWS + 1) * n, lp_ref=d["ref"].reshape(-1) if cfg.kl_coef else None,
                      entropy=-lp.exp() * lp if sampled_entropy else h)
    out.loss.backward()
    return out.loss.detach(), model.w.grad.clone()


def _rl_namespace(**kw):
    parser = argparse.ArgumentParser()
    add_megatron_rl_tis_arguments(parser)
    ns = parser.parse_args(kw.pop("argv", []))
    base = dict(grpo_clamp_eps_lower=0.2, grpo_clamp_eps_upper=0.28, grpo_kl_beta=0.05, grpo_entropy_term_weight=0.01,
                rl_inference_logprobs_is_correction=True, rl_importance_sampling_truncation_coef=1.5,
                rl_use_sequence_packing=False, calculate_per_token_loss=False, rl_default_temperature=1.0)
    for k, v in {**base, **kw}.items():
        setattr(ns, k, v)
    return ns


@pytest.mark.parametrize("per_token", [False, True])
def test_algorithm_2_token_truncate_reproduces_calculate_grpo_loss(per_token: bool) -> None:
    """Megatron-LM's flags alone (correction on, coefficient 1.5, KL beta, entropy weight): the host's loss and
    gradient equal ``train_rl.forward_step`` + ``calculate_grpo_loss`` + the schedule's reduction, one micro-batch
    (where Megatron-LM's per-micro-batch mean and the plugin's global token mean coincide) and, with
    ``--calculate-per-token-loss``, two. Tolerance: float32, the same terms summed in another order: a few ulp of
    the summed absolute per-token loss."""
    m = 2 if per_token else 1
    ns = _rl_namespace(calculate_per_token_loss=per_token)
    args = RLArgs(**{k: getattr(ns, k) for k in RLArgs.__dataclass_fields__ if hasattr(ns, k)})
    for seed in range(3):
        d = _data(seed)
        items = _unpacked_items(d, m)
        model = Bigram()
        total = torch.zeros(())
        def logprobs_of(t, p, model=model):
            return torch.log_softmax(model(t)[:, :-1], -1).gather(-1, t[:, 1:, None]).squeeze(-1)

        for item in items:
            out, lf = forward_step(item, logprobs_of, args)
            s, n, _ = lf(out)
            total = total + scheduled_loss(s, n, m, args)
        total.backward()
        total = total.detach()
        g_mlm = model.w.grad.clone()
        host = RLHost.from_args(ns, m)
        assert host.cfg.algorithm == 2 and host.cfg.upper_bound == 1.5
        loss, grad, _ = _run_host(host, items, Bigram())
        scale = float(d["mask"][:, 1:].sum()) if per_token else 1.0
        tol = 16 * EPS32 * max(1.0, abs(float(total)))
        assert abs(float(loss) - float(total)) <= tol * scale, (float(loss), float(total))
        torch.testing.assert_close(grad, g_mlm, rtol=0, atol=16 * EPS32 * float(g_mlm.abs().max()))


CASES = [
    dict(),                                                                  # algorithm 0
    dict(use_rollout_log_probs=True),                                        # 1
    dict(use_tis=True),                                                      # 2
    dict(use_tis=True, use_rollout_log_probs=True),                          # 3
    dict(use_tis=True, level="sequence", mode="clip", lower=0.5, upper=3.0),
    dict(use_tis=True, level="geometric", mode="mask", lower=0.8, upper=1.25),
    dict(use_tis=True, mode="mask", upper=1.6, lower=0.6, rejected_denominator="drop"),
    dict(use_tis=True, batch_normalize=True),
    dict(use_tis=True, use_rollout_log_probs=True, loss_agg="seq-mean-token-mean", kl_coef=0.1,
         kl_estimator="k2", entropy_coef=0.02),
    dict(use_tis=True, loss_agg="seq-mean-token-sum", kl_coef=0.1, kl_estimator="k3"),
]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_every_algorithm_level_and_rule_through_the_host_equals_the_core(case: dict, packed: bool) -> None:
    """The host over several micro-batches (unpacked rows or packed bins) at temperature 0.7 = one core
    ``policy_loss`` on the whole batch with the log-probs of ``softmax(logits / 0.7)``: the global denominator
    and the step's batch normalisation make the split invisible. Tolerance: float32 sums in another order."""
    try:
        cfg = TISConfig(**case)
    except ValueError as e:
        pytest.skip(f"not a valid configuration here: {e}")
    d = _data(11)
    items = _packed_items(d) if packed else _unpacked_items(d, 3)
    host = RLHost(cfg, len(items), packed=packed, temperature=0.7)
    loss, grad, _ = _run_host(host, items, Bigram())
    want, g_core = _core(cfg, d, temperature=0.7)
    assert abs(float(loss) - float(want)) <= 64 * EPS32 * max(1.0, abs(float(want))), (float(loss), float(want))
    torch.testing.assert_close(grad, g_core, rtol=1e-5, atol=64 * EPS32 * float(g_core.abs().max()))


def test_packed_bins_equal_unpacked_rows_loss_gradient_and_metrics() -> None:
    """Same sequences, two layouts, different micro-batch counts: the same loss, gradient and ``tis/*`` metrics
    as Megatron-LM's ``train_step`` logs them (the pairs summed over micro-batches)."""
    cfg = TISConfig(use_tis=True, level="sequence", mode="clip", upper=3.0, lower=0.4, kl_coef=0.05)
    d = _data(5)
    res = {}
    for packed in (False, True):
        items = _packed_items(d) if packed else _unpacked_items(d, 2)
        host = RLHost(cfg, len(items), packed=packed, temperature=0.9)
        loss, grad, dicts = _run_host(host, items, Bigram())
        res[packed] = (loss, grad, train_step_loss_reduced(dicts), len(items))
    (l0, g0, m0, n0), (l1, g1, m1, n1) = res[False], res[True]
    assert n0 != n1
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    tis = [k for k in m0 if k.startswith("tis/")]
    assert len(tis) >= 5 and set(m0) == set(m1)
    for k in m0:
        torch.testing.assert_close(m1[k], m0[k], rtol=1e-5, atol=1e-6, msg=k)
    torch.testing.assert_close(m0["lm loss"], l0, rtol=1e-6, atol=1e-7)


def test_the_loaders_eleven_part_bins_equal_the_bin_objects() -> None:
    """``load_packed_data_by_index``'s 11-tuple (bin index read through ``read_item``) gives the same step."""
    cfg = TISConfig(use_tis=True, level="geometric", mode="clip", upper=1.5, lower=0.7)
    d = _data(8)
    items = _packed_items(d)
    parts = [(b.tokens, adv, old, b.loss_mask, b.position_ids, ref, inf, b.seq_starts, b.seq_lengths,
              b.seq_indices, None) for b, adv, old, ref, inf in items]
    a = _run_host(RLHost(cfg, len(items), packed=True), items, Bigram())
    b = _run_host(RLHost(cfg, len(items), packed=True, read_item=lambda i: parts[int(i[0])]),
                  [(torch.tensor(i),) for i in range(len(items))], Bigram())
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_tis_metrics_are_the_engines_in_megatron_lms_log() -> None:
    """``train_step``'s reduction of the host's dicts gives each ``engine.end()`` metric unchanged."""
    d = _data(3)
    host = RLHost(TISConfig(use_tis=True), 3)
    _, _, dicts = _run_host(host, _unpacked_items(d, 3), Bigram())
    logged = train_step_loss_reduced(dicts)
    assert host.metrics and all(k in logged for k in host.metrics)
    for k, v in host.metrics.items():
        assert float(logged[k]) == pytest.approx(float(v), rel=1e-6, abs=1e-7), k


def _megatron_ddp(module: torch.nn.Module, dp_cp: int, per_token: bool) -> torch.nn.Module:
    """A megatron-core ``DistributedDataParallel`` as the schedule hands it to ``forward_step``, its process group
    ``dp_cp`` ranks (the attributes the wrapper reading uses; no process group is built in one process)."""
    from megatron.core.distributed import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)
    torch.nn.Module.__init__(ddp)
    ddp.module = module
    ddp.config = types.SimpleNamespace(calculate_per_token_loss=per_token)
    ddp.dp_cp_group = types.SimpleNamespace(size=lambda: dp_cp)
    return ddp


def test_gradient_divisor_is_read_from_the_models_wrapper() -> None:
    """The 2-tuple's ``g`` is the divisor of the wrapper the schedule hands ``forward_step``, as in the megatron-core
    hook (``engine.megatron_schedule``): megatron DDP averaging over 4 ranks returns 4 times the bare model's loss
    (one process: ``R = 1``, ``cp = 1``); a DDP wrapper built without ``--calculate-per-token-loss`` under the flag
    is refused in one line."""
    d = _data(3)

    def unwrap(model, tokens, pos, b):
        return getattr(model, "module", model)(tokens)

    returned = []
    for wrap in (False, True):
        host = RLHost(TISConfig(use_tis=True), 2, model_forward=unwrap)
        model = _megatron_ddp(Bigram(), 4, per_token=False) if wrap else Bigram()
        output, loss_func = host.forward_step(iter(_unpacked_items(d, 2)), model)
        returned.append(loss_func(output)[0])
    assert torch.equal(returned[1], 4 * returned[0])
    host = RLHost(TISConfig(use_tis=True), 2, per_token=True, model_forward=unwrap)
    with pytest.raises(ValueError, match="calculate_per_token_loss=False"):
        host.forward_step(iter(_unpacked_items(d, 2)), _megatron_ddp(Bigram(), 4, per_token=False))


def test_the_three_defects_do_not_occur() -> None:
    """(1) pi_old = inference log-probs = -9 in float32: every weight is exactly 1 and pi_old is float32;
    (2) the temperature divides the training logits (loss = the core's at T = 0.7, not at T = 1);
    (3) the correction without a truncation coefficient or upper bound is refused; with a bound a 100-nat
    log-ratio gives a finite loss."""
    d = _data(2)
    d["old"] = torch.full_like(d["old"], -9.0)
    d["inf"] = d["old"].clone()
    host = RLHost(TISConfig(use_tis=True), 1)
    item = _unpacked_items(d, 1)
    it = iter(item)
    out, _ = host.forward_step(it, Bigram())
    batch = item_to_batch(item[0], host.cfg, packed=False)[0]
    assert batch.old_log_probs.dtype == torch.float32 and batch.rollout_log_probs.dtype == torch.float32
    lp = torch.log_softmax(out[:, :-1], -1).gather(-1, d["tokens"][:, 1:, None]).squeeze(-1).reshape(-1)
    res = host.engine.loss(batch, lp.detach())
    kept = batch.loss_mask != 0
    assert kept.sum() > 20 and torch.equal(res.weights[kept], torch.ones(int(kept.sum())))

    cfg = TISConfig(use_tis=True, kl_coef=0.0)
    d = _data(4)
    at07 = RLHost(cfg, 1, temperature=0.7)
    loss07, _, _ = _run_host(at07, _unpacked_items(d, 1), Bigram())
    assert abs(float(loss07) - float(_core(cfg, d, 0.7)[0])) < 1e-5
    assert abs(float(loss07) - float(_core(cfg, d, 1.0)[0])) > 1e-3

    with pytest.raises(ValueError, match="no upper bound") as e:
        config_from_megatron_rl_args(_rl_namespace(rl_importance_sampling_truncation_coef=None))
    assert "\n" not in str(e.value)
    d["inf"] = d["old"] - 100.0
    host = RLHost.from_args(_rl_namespace(rl_importance_sampling_truncation_coef=None,
                                          argv=["--tis-upper-bound", "2.0"]), 1)
    loss, grad, _ = _run_host(host, _unpacked_items(d, 1), Bigram())
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


def test_launcher_hands_a_parsing_pretrain_the_host_forward_step_and_the_flags() -> None:
    """megatron-core <= 0.17's ``pretrain(..., forward_step_func, extra_args_provider=...)`` parses the command line
    itself: ``install`` replaces the forward step (positional or keyword) and chains the script's
    ``extra_args_provider`` with the plugin's flags. (From 0.18 on, ``pretrain(cfg_container, ...)`` takes no
    ``extra_args_provider`` and the script parses first: tests/dist/test_megatron_rl_real_tree.py runs that flow on
    Megatron-LM's real tree.)"""
    seen = {}

    def pretrain(provider, model_provider, model_type, forward_step_func, extra_args_provider=None, **kw):
        seen["fs"], seen["extra"] = forward_step_func, extra_args_provider

    def own_forward_step(data_iterator, model):
        raise AssertionError("train_rl's forward_step must not run")

    def own_args(parser):
        parser.add_argument("--grpo-kl-beta", type=float, default=0.001)
        return parser

    old = types.SimpleNamespace(pretrain=pretrain)
    install(old)
    old.pretrain(None, None, None, own_forward_step, extra_args_provider=own_args)
    assert seen["fs"] is not own_forward_step and seen["fs"].__name__ == "forward_step"
    ns = seen["extra"](argparse.ArgumentParser()).parse_args(["--use-tis", "--grpo-kl-beta", "0.01"])
    assert ns.use_tis and ns.grpo_kl_beta == 0.01
    old.pretrain(None, None, None, forward_step_func=own_forward_step)
    assert seen["fs"] is not own_forward_step and seen["extra"] is not None


class _CountingReducer(LocalReducer):
    def __init__(self):
        self.n = 0

    def sequence_sum(self, x):
        self.n += 1
        return super().sequence_sum(x)

    def batch_sum(self, x, *, per_sequence: bool = False):
        self.n += 1
        return super().batch_sum(x, per_sequence=per_sequence)

    def batch_min(self, x):
        self.n += 1
        return super().batch_min(x)

    def batch_max(self, x):
        self.n += 1
        return super().batch_max(x)


@pytest.mark.parametrize("denominator", ["keep", "drop"])
@pytest.mark.parametrize("algorithm", [0, 1, 2, 3])
def test_the_host_corrects_each_micro_batch_once_in_the_loss(monkeypatch, algorithm, denominator) -> None:
    """Two steps of three micro-batches: each loss call runs the correction exactly once and the same number of
    reductions;
    ``begin`` corrects each micro-batch once where ``drop`` or algorithm 2's batch normalisation need it before the
    first loss, else never (``tests/test_engine_correction_counts.py``'s counts, this host)."""
    import slime_tis.core.correction as correction_mod
    import slime_tis.core.losses as losses_mod

    count = {"corrections": 0}
    real = correction_mod.correct

    def counted(*a, **k):
        count["corrections"] += 1
        return real(*a, **k)

    monkeypatch.setattr(correction_mod, "correct", counted)
    monkeypatch.setattr(losses_mod, "correct", counted)
    reducer = _CountingReducer()
    monkeypatch.setattr("slime_tis.megatron_rl.host.parallel_context", lambda: ParallelContext(0, 1, reducer))
    rules = {} if algorithm == 0 else dict(mode="mask", level="geometric", upper=1.3, veto_threshold=1e-3)
    cfg = TISConfig(use_rollout_log_probs=algorithm in (1, 3), use_tis=algorithm in (2, 3),
                    rejected_denominator=denominator, batch_normalize=algorithm == 2, **rules)
    host, model = RLHost(cfg, 3), Bigram()
    d = _data(9)
    items = _unpacked_items(d, 3) * 2
    it = iter(items)
    begin, losses = [], []
    for _ in items:
        before = (count["corrections"], reducer.n)
        output, loss_func = host.forward_step(it, model)
        mid = (count["corrections"], reducer.n)
        loss_func(output)
        after = (count["corrections"], reducer.n)
        if len(losses) % 3 == 0:                        # the step's first call: begin runs here
            begin.append((mid[0] - before[0], mid[1] - before[1]))
        losses.append((after[0] - mid[0], after[1] - mid[1]))
    assert {c for c, _ in losses} == {1}, losses
    assert len({r for _, r in losses[:2] + losses[3:5]}) == 1, losses   # the last one also ends the step
    assert losses[2] == losses[5]
    needs = denominator == "drop" or algorithm == 2
    assert [c for c, _ in begin] == [3 if needs else 0] * 2, begin


def test_a_padding_bin_trains_nothing_and_counts_no_sequence() -> None:
    """Megatron-LM evens the bins over DP ranks with empty ones (no sequences, no advantages): a step with one more
    such bin gives the same loss and gradient, and Megatron-LM's sequence count is unchanged."""
    cfg = TISConfig(use_tis=True, level="sequence", mode="clip", upper=2.0, lower=0.5, loss_agg="seq-mean-token-mean")
    items = _packed_items(_data(6))
    b0 = items[0][0]
    empty = (type(b0)(torch.zeros_like(b0.tokens), b0.position_ids, torch.zeros_like(b0.loss_mask), [], [], []),
             torch.zeros(0), torch.zeros(1, 15), torch.zeros(1, 15), torch.zeros(1, 15))
    counts = []
    res = []
    for its in (items, items + [empty]):
        seen = []
        host = RLHost(cfg, len(its), packed=True, on_sequences=seen.append)
        res.append(_run_host(host, its, Bigram()))
        counts.append(sum(seen))
    assert counts[0] == counts[1] == ROWS
    torch.testing.assert_close(res[1][0], res[0][0], rtol=0, atol=0)
    torch.testing.assert_close(res[1][1], res[0][1], rtol=0, atol=0)


def test_unpacked_rows_get_the_packed_seq_params_train_rl_passes() -> None:
    """As ``train_rl.forward_step`` (and ``get_logprobs``) at d98e8a64dd, for a micro-batch of one row: no
    attention mask, THD ``packed_seq_params`` with one sequence spanning the row (``cu_seqlens = [0, S]``,
    ``max_seqlen = S``) and no ``total_tokens``; several rows get none (``default_model_forward``)."""
    d = _data(1)
    host, model = RLHost(TISConfig(use_tis=True), ROWS), Bigram()
    host.forward_step(iter(_unpacked_items(d, ROWS)), model)
    mask, params = model.seen
    assert mask is None and params is not None and params.qkv_format == "thd"
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, COLS]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == COLS
    assert getattr(params, "total_tokens", None) is None
    host, model = RLHost(TISConfig(use_tis=True), 2), Bigram()   # several rows a micro-batch: no THD parameters
    host.forward_step(iter(_unpacked_items(d, 2)), model)
    assert model.seen == (None, None)

