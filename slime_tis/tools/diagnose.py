"""``slime-tis diagnose``: off-policy diagnostics of a log-prob dump (docs/dump_format.md) and a recommendation.

Every number comes from the core (:func:`slime_tis.compute_tis` on the packed dump). The report: the ``tis/``
metrics under the configuration given (algorithm 2 by default) and what it would do to the dump; percentiles of the
token, sequence, geometric and per-sequence minimum log-ratios; metrics per response-length bucket (quartile edges
by default); the recommendation and its reasons (the rules: docs/troubleshooting.md, "Symptom, cause, fix"); with
``rollout_log_mass``, the share of ``k3`` the sampling support explains, ``1 - k3(l_replay) / k3(l_full)`` with
``l_full = l_replay + log S`` (docs/sampling_support.md); with a recorded cause, the mismatch by cause
(:mod:`slime_tis.tools.causes`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor

from slime_tis.config import FLAG_OF, TISConfig
from slime_tis.core import compute_tis
from slime_tis.core.correction import TISResult
from slime_tis.core.levels import GEOMETRIC, LEVELS
from slime_tis.tools.causes import format_causes, k3, log_ratios, mismatch_by_cause
from slime_tis.tools.dump import LogprobDump

__all__ = ["PERCENTILES", "Diagnosis", "Recommendation", "diagnose", "format_report", "write_histogram"]

PERCENTILES = (0.0, 1.0, 5.0, 25.0, 50.0, 75.0, 95.0, 99.0, 100.0)
#: The bounds a level's units are tested against: its rejecting default ``[1 / upper, upper]`` (``core.levels``).
LEVEL_BOUNDS = {name: (1.0 / level.rejection_upper, level.rejection_upper) for name, level in LEVELS.items()}
CATASTROPHIC = 1e-4


@dataclass
class Recommendation:
    """A configuration (``TISConfig`` fields) and why, with the core's metrics under it."""

    fields: dict[str, Any]
    reasons: list[str]
    metrics: dict[str, float] = field(default_factory=dict)

    def _settings(self) -> list[tuple[str, str | None]]:
        """``(flag, value)`` of every field set, in flag order; value ``None`` for a switch."""
        out = []
        for key in ("mode", "level", "upper", "lower", "veto_threshold", "batch_normalize"):
            value = self.fields.get(key)
            if value is True:
                out.append((FLAG_OF[key], None))
            elif value is not None and value is not False:
                out.append((FLAG_OF[key], f"{value:g}" if isinstance(value, float) else f"{value}"))
        return out

    @property
    def yaml(self) -> str:
        """As slime takes it: its ``--use-tis`` flag, then the keys of the ``--custom-config-path`` file (each
        flag's argparse dest)."""
        keys = [f"    {flag.lstrip('-').replace('-', '_')}: {value or 'true'}" for flag, value in self._settings()]
        head = ["slime flag: --use-tis", "slime --custom-config-path YAML:"]
        return "\n  ".join([*head, *keys]) if self.fields else _NOTHING

    @property
    def flags(self) -> str:
        parts = [flag if value is None else f"{flag} {value}" for flag, value in self._settings()]
        return " ".join(["--use-tis", *parts]) if self.fields else _NOTHING


_NOTHING = "(none: nothing to base a recommendation on)"


@dataclass
class Diagnosis:
    """Everything the report shows (plain numbers, JSON-serialisable via ``as_dict``)."""

    n_seq: int
    n_tokens: int
    config: str
    overall: dict[str, float]
    percentiles: dict[str, list[float]]
    buckets: list[dict[str, float]]
    recommendation: Recommendation
    usable_tokens: int = -1  # valid tokens of finite sequences (the diagnostic domain); 0 = nothing to diagnose
    support: dict[str, float] | None = None  # the sampling-support section (:func:`support_explained`)
    causes: dict[str, Any] | None = None  # the mismatch by cause (:func:`slime_tis.tools.causes.mismatch_by_cause`)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out["percentiles"] = {"q": list(PERCENTILES), **self.percentiles}
        out["recommendation"]["flags"] = self.recommendation.flags
        return out


def _run(cfg: TISConfig, dump: LogprobDump) -> TISResult:
    return compute_tis(cfg, dump.train_log_probs, dump.rollout_log_probs, dump.loss_mask, dump.cu_seqlens)


def _metrics(cfg: TISConfig, dump: LogprobDump) -> dict[str, float]:
    """The core's ``tis/`` metrics of ``dump`` under ``cfg``."""
    return {k: float(v) for k, v in _run(cfg, dump).stats.finalize().items()}  # host-sync-ok (offline tool)


def quantiles(x: Tensor, qs: list[float] | tuple[float, ...]) -> list[float]:
    """Quantiles ``qs`` (in [0, 1]) of ``x`` as ``torch.quantile`` (linear): ``s[lo] + (h - lo) (s[lo + 1] - s[lo])``,
    ``s`` sorted, ``h = q (n - 1)``, ``lo = floor(h)``; one float64 sort, any size (``torch.quantile`` stops at
    2**24). NaN for an empty input or one holding a NaN."""
    n = x.numel()
    if n == 0:
        return [math.nan] * len(qs)
    s = torch.sort(x.detach().reshape(-1).double()).values
    if bool(torch.isnan(s[-1])):  # NaN sorts last
        return [math.nan] * len(qs)
    out = []
    for q in qs:
        h = q * (n - 1)
        lo = min(int(math.floor(h)), n - 1)
        hi = min(lo + 1, n - 1)
        a, b = float(s[lo]), float(s[hi])
        out.append(a + (h - lo) * (b - a) if b != a else a)
    return out


def _outside_fraction(dump: LogprobDump, level: str) -> float:
    lower, upper = LEVEL_BOUNDS[level]
    m = _metrics(TISConfig(use_tis=True, mode="clip", level=level, lower=lower, upper=upper), dump)
    return m.get("tis/clip_fraction_low", 0.0) + m.get("tis/clip_fraction_high", 0.0)


def _distributions(dump: LogprobDump) -> dict[str, Tensor]:
    """Per-token and per-sequence log-ratio samples from the core's bookkeeping (finite domain)."""
    rt = _run(TISConfig(use_tis=True), dump).ratios
    tok = rt.log_ratio[rt.token_ok]
    seq_sum = rt.seq_log_ratio_sum[rt.seq_ok]
    seq_geo = GEOMETRIC.of(rt)[rt.seq_ok]
    seq_min = torch.full((rt.seq_ok.numel(),), math.inf).scatter_reduce(
        0, rt.seq_id, torch.where(rt.token_ok, rt.log_ratio, math.inf), reduce="amin")[rt.seq_ok]
    return {"token log-ratio": tok, "token ratio": torch.exp(tok.double()), "sequence log-ratio": seq_sum,
            "geometric log-ratio": seq_geo, "min token log-ratio": seq_min}


def _bucket_edges(valid_lengths: Tensor, edges: list[int] | None) -> list[int]:
    lengths = valid_lengths[valid_lengths > 0]
    if edges is None:
        if lengths.numel() == 0:
            return [0, 1]
        edges = sorted({int(math.ceil(v)) for v in quantiles(lengths, [0.25, 0.5, 0.75])})
    top = int(lengths.max()) + 1 if lengths.numel() else 1
    return sorted({1, *[e for e in edges if 1 < e < top], top})


def _buckets(dump: LogprobDump, edges: list[int] | None) -> list[dict[str, float]]:
    vl = dump.valid_lengths
    out = []
    bounds = _bucket_edges(vl, edges)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sel = (vl >= lo) & (vl < hi)
        if not bool(sel.any()):
            continue
        sub = dump.select(sel)
        m = _metrics(TISConfig(use_tis=True), sub)
        out.append({
            "len_lo": lo, "len_hi": hi - 1, "n_seq": int(sel.sum()), "mean_len": float(vl[sel].double().mean()),
            "kl": m["tis/kl"], "k3_kl": m["tis/k3_kl"], "chi2_seq": m["tis/chi2_seq"],
            "nonfinite_seq_fraction": m["tis/nonfinite_seq_fraction"],
            **{f"out_{level}": _outside_fraction(sub, level) for level in LEVEL_BOUNDS},
        })
    return out


def _recommend(dump: LogprobDump, overall: dict[str, float], dists: dict[str, Tensor],
               buckets: list[dict[str, float]]) -> Recommendation:
    """Called with a usable token: every distribution and the buckets are non-empty."""
    reasons: list[str] = []
    out_tok = _outside_fraction(dump, "token")
    out_seq = _outside_fraction(dump, "sequence")
    long_out_seq = buckets[-1]["out_sequence"]
    k3 = overall.get("tis/k3_kl", 0.0)
    fields: dict[str, Any]
    if k3 < 1e-4 and out_tok < 1e-3:
        fields = dict(mode="truncate", level="token", upper=2.0)
        reasons.append(f"negligible mismatch: k3_kl = {k3:.2e} < 1e-4 and {100 * out_tok:.3f}% of tokens have a "
                       "ratio outside [0.5, 2]; token-level truncation at 2 is harmless (it rarely acts)")
    elif out_seq > 0.2 or long_out_seq > 0.5:
        geo = dists["geometric log-ratio"].abs()
        upper = math.ceil(max(1.001, math.exp(quantiles(geo, [0.9])[0])) * 1e4) / 1e4
        fields = dict(mode="mask", level="geometric", upper=upper, lower=round(1.0 / upper, 6))
        reasons.append(
            f"sequence-level weights saturate: {100 * out_seq:.1f}% of sequences (and {100 * long_out_seq:.1f}% "
            f"of the longest bucket, {buckets[-1]['len_lo']}+ tokens) have exp(sum_t l_t) outside "
            "[0.5, 2]; the sequence ratio explodes or vanishes with length (T x KL), so sequence-level truncation "
            "would clip almost every long sequence")
        reasons.append(f"geometric-level masking with upper = {upper:g} (the 90th percentile of exp(|mean_t l_t|)) "
                       "rejects about 10% of sequences, independent of their length")
    else:
        r = dists["token ratio"]
        if out_seq <= 0.05:
            fields = dict(mode="truncate", level="sequence", upper=2.0)
            reasons.append(f"sequence ratios are mostly in range ({100 * out_seq:.1f}% outside [0.5, 2]): "
                           "sequence-level truncated IS is the less biased estimator and does not saturate here")
        else:
            q99 = quantiles(r, [0.99])[0]
            upper = round(min(5.0, max(1.5, q99)), 3)
            fields = dict(mode="truncate", level="token", upper=upper)
            reasons.append(f"{100 * out_seq:.1f}% of sequence ratios fall outside [0.5, 2] (too many to truncate at "
                           f"sequence level, too few to call it a length trap): token-level truncation at the 99th "
                           f"percentile of r_t ({q99:.3g}, clamped to [1.5, 5])")
    seq_min = dists["min token log-ratio"]
    n_cat = int((seq_min < math.log(CATASTROPHIC)).sum())
    if n_cat:
        fields["veto_threshold"] = CATASTROPHIC
        reasons.append(f"{n_cat} sequence(s) ({100 * n_cat / seq_min.numel():.2f}%) contain a catastrophic "
                       f"token with r_t < {CATASTROPHIC:g}: veto them (--tis-veto-threshold {CATASTROPHIC:g})")
    if overall.get("tis/nonfinite_seq_fraction", 0.0) > 0:
        reasons.append(f"{100 * overall['tis/nonfinite_seq_fraction']:.2f}% of sequences have non-finite "
                       "log-probs at valid tokens (rejected in training); check the SGLang parser's warnings")
    cfg = TISConfig(use_tis=True, **fields)
    rec = _metrics(cfg, dump)
    w_mean = rec.get("tis/weight_mean", 1.0)
    if not cfg.plan.mode.masks and abs(w_mean - 1.0) > 0.05:
        fields["batch_normalize"] = True
        reasons.append(f"the recommended weights average {w_mean:.3f} (off 1 by more than 5%): batch-normalise them")
        rec = _metrics(TISConfig(use_tis=True, **fields), dump)
    keys = ("tis/rejected_token_fraction", "tis/rejected_seq_fraction", "tis/ess", "tis/weight_mean",
            "tis/truncate_fraction", "tis/mask_fraction_low", "tis/mask_fraction_high", "tis/veto_seq_fraction")
    return Recommendation(fields, reasons, {k: rec[k] for k in keys if k in rec})


def diagnose(dump: LogprobDump, cfg: TISConfig | None = None, *, bucket_edges: list[int] | None = None) -> Diagnosis:
    """Diagnostics of ``dump`` (module docstring). ``cfg``: the user's configuration for the overall
    metrics, evaluated as given (default: algorithm 2, token-level truncation at 2); algorithms 0 and 1 apply
    no weights, so their weight statistics are those of weights 1."""
    if dump.n_seq == 0:
        raise ValueError("the dump holds no sequence")
    cfg = cfg or TISConfig(use_tis=True)
    overall = _metrics(cfg, dump)
    dists = _distributions(dump)
    buckets = _buckets(dump, bucket_edges)
    usable = int(dists["token log-ratio"].numel())
    n_valid = int(torch.count_nonzero(dump.loss_mask))  # an integer count: exact beyond 2^24 tokens
    rec = _recommend(dump, overall, dists, buckets) if usable else _no_domain(dump, n_valid, overall)
    return Diagnosis(
        n_seq=dump.n_seq, n_tokens=n_valid, config=cfg.describe(), overall=overall,
        percentiles={k: quantiles(v, [q / 100 for q in PERCENTILES]) for k, v in dists.items()}, buckets=buckets,
        recommendation=rec, usable_tokens=usable, support=support_explained(dump), causes=mismatch_by_cause(dump))


def support_explained(dump: LogprobDump) -> dict[str, float] | None:
    """Mean ratio, ``k3`` and fraction outside [0.9, 1.1] with the train log-probs over the full vocabulary and over
    the sampled support, and the share of ``k3`` the support explains (module docstring), over valid tokens with
    finite values; ``None`` when the dump carries no ``rollout_log_mass``."""
    if dump.rollout_log_mass is None:
        return None
    _, full, mass = log_ratios(dump)
    replayed = dump.meta.get("sampling_support") == "replay"
    out: dict[str, float] = {"tokens": float(full.numel()), "train_log_probs_over_support": float(replayed),
                             "kept_mass_mean": float(mass.exp().mean())}  # means of no token: NaN
    for mode, lr in (("full", full), ("replay", full - mass)):
        r = lr.exp()
        out[f"{mode}_ratio_mean"] = float(r.mean())
        out[f"{mode}_k3"] = float(k3(lr).mean())
        out[f"{mode}_outside_10pct"] = float(((r < 0.9) | (r > 1.1)).double().mean())
    k3_full = out["full_k3"]
    out["explained"] = 1.0 - out["replay_k3"] / k3_full if k3_full > 0 else math.nan
    return out


def _no_domain(dump: LogprobDump, n_valid: int, overall: dict[str, float]) -> Recommendation:
    """No valid token of a finite sequence: every statistic would be an empty mean; say so."""
    nonfinite = overall.get("tis/nonfinite_seq_fraction", 0.0)
    why = (f"no usable token: {dump.n_seq} sequence(s) with {n_valid} valid (loss_mask = 1) token(s)"
           + (f", {100 * nonfinite:.1f}% of sequences with non-finite log-probs at valid tokens" if nonfinite else "")
           + "; the mismatch cannot be measured and no configuration is recommended (check the dump's loss_mask "
           "and log-probs)")
    return Recommendation({}, [why])


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "nan"
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4f}"
    return f"{v:.3e}"


#: what the configuration given does to the dump's tokens: (metric, what it counts)
ACTIONS = (
    ("tis/truncate_fraction", "weights truncated at the upper bound (kept, capped)"),
    ("tis/clip_fraction_low", "weights clipped up to the lower bound (kept)"),
    ("tis/clip_fraction_high", "weights clipped down to the upper bound (kept)"),
    ("tis/mask_fraction_low", "units rejected below the lower bound"),
    ("tis/mask_fraction_high", "units rejected above the upper bound"),
    ("tis/rs_fraction_low", "rejection-sampling units rejected below its lower bound"),
    ("tis/rs_fraction_high", "rejection-sampling units rejected above its upper bound"),
    ("tis/veto_seq_fraction", "sequences vetoed (a token with r_t below the veto)"),
    ("tis/nonfinite_seq_fraction", "sequences rejected for non-finite log-probs"),
)


def given_actions(overall: dict[str, float]) -> list[str]:
    """What the configuration given would do to this dump: one line per action that fires (``ACTIONS`` and every
    rule's ``*_fraction``), then the rejected token and sequence fractions; ``nothing`` when no rule fires."""
    names = dict(ACTIONS)
    rules = [k for k in overall if k.endswith("_fraction") and k not in names and k.startswith("tis/")
             and k not in ("tis/rejected_token_fraction", "tis/rejected_seq_fraction", "tis/rs_seq_masked_fraction",
                           "tis/token_ratio_outside_10pct_fraction", "tis/catastrophic_token_fraction",
                           "tis/catastrophic_upper_token_fraction")]
    lines = [f"{100 * overall[k]:.2f}% {names.get(k, 'rejected by ' + k[4:-len('_fraction')])} ({k})"
             for k in [*names, *rules] if overall.get(k, 0.0) > 0]
    rej_tok, rej_seq = overall.get("tis/rejected_token_fraction", 0.0), overall.get("tis/rejected_seq_fraction", 0.0)
    lines.append(f"rejects {100 * rej_tok:.2f}% of tokens and {100 * rej_seq:.2f}% of sequences in all"
                 if rej_tok or rej_seq else "rejects nothing")
    return lines


def format_report(d: Diagnosis, fmt: str = "flags") -> str:
    """The text report printed by ``slime-tis diagnose``; ``fmt``: the recommendation as ``flags`` or as slime's
    ``yaml`` keys."""
    head = f"slime-tis diagnose: {d.n_seq} sequences, {d.n_tokens} valid tokens"
    if d.usable_tokens >= 0 and d.usable_tokens != d.n_tokens:
        head += f" ({d.usable_tokens} in sequences with finite log-probs)"
    lines = [head, "", "configuration:", d.config,
             "", "overall (core metrics under this configuration):"]
    keys = ["tis/kl", "tis/k3_kl", "tis/chi2_token", "tis/chi2_seq", "tis/log_ppl_diff", "tis/ppl_ratio",
            "tis/ratio_mean", "tis/ratio_std", "tis/ratio_min", "tis/ratio_max", "tis/ess", "tis/weight_mean",
            "tis/truncate_fraction", "tis/clip_fraction_low", "tis/clip_fraction_high", "tis/mask_fraction_low",
            "tis/mask_fraction_high", "tis/rejected_token_fraction", "tis/rejected_seq_fraction",
            "tis/nonfinite_seq_fraction"]
    lines += [f"  {k:<28} {_fmt(d.overall[k])}" for k in keys if k in d.overall]
    lines += ["", "what this configuration would do to the dump:"] + [f"  {a}" for a in given_actions(d.overall)]
    head = "  " + f"{'quantity':<22}" + "".join(f"{('p' + format(q, 'g')):>11}" for q in PERCENTILES)
    lines += ["", "percentiles (finite sequences, valid tokens):", head]
    for name, vals in d.percentiles.items():
        lines.append("  " + f"{name:<22}" + "".join(f"{_fmt(v):>11}" for v in vals))
    lines += ["", "by response length (valid tokens):",
              "  " + f"{'length':<13}{'seqs':>6}{'mean len':>10}{'kl':>11}{'k3_kl':>11}{'chi2_seq':>11}"
              f"{'tok out':>9}{'seq out':>9}{'geo out':>9}"]
    for b in d.buckets:
        lines.append("  " + f"{str(b['len_lo']) + '-' + str(b['len_hi']):<13}{b['n_seq']:>6}{b['mean_len']:>10.1f}"
                     f"{_fmt(b['kl']):>11}{_fmt(b['k3_kl']):>11}{_fmt(b['chi2_seq']):>11}"
                     f"{100 * b['out_token']:>8.1f}%{100 * b['out_sequence']:>8.1f}%{100 * b['out_geometric']:>8.1f}%")
    lines.append("  (out = fraction of units outside [0.5, 2] at token / sequence level, [1/1.001, 1.001] geometric: "
                 "geometric masking's default bound, which a per-token drift of 0.1% leaves)")
    r = d.recommendation
    lines += ["", "recommendation:", f"  {r.yaml if fmt == 'yaml' else r.flags}"]
    lines += [f"  - {why}" for why in r.reasons]
    if r.metrics:
        lines.append("  under it: " + ", ".join(f"{k.split('/')[1]}={_fmt(v)}" for k, v in r.metrics.items()))
    if d.support is not None:
        s = d.support
        dumped = "the sampled support (replay)" if s["train_log_probs_over_support"] else "the full vocabulary"
        lines += ["", f"sampling support (top-p / top-k; train log-probs in the dump: over {dumped}):",
                  f"  {int(s['tokens'])} tokens, mean kept mass {_fmt(s['kept_mass_mean'])}",
                  f"  {'trainer log-probs over':<26}{'mean ratio':>12}{'k3_kl':>12}{'outside [0.9, 1.1]':>20}"]
        for mode, what in (("full", "the full vocabulary"), ("replay", "the sampled support")):
            lines.append(f"  {what:<26}{_fmt(s[mode + '_ratio_mean']):>12}{_fmt(s[mode + '_k3']):>12}"
                         f"{100 * s[mode + '_outside_10pct']:>19.1f}%")
        lines.append(f"  the support explains {100 * s['explained']:.1f}% of the full-vocabulary k3_kl"
                     + ("" if s["train_log_probs_over_support"] else
                        " (--tis-sampling-support replay removes it: docs/sampling_support.md)"))
    if d.causes is not None:
        lines += [""] + format_causes(d.causes)
    return "\n".join(lines)


def write_histogram(dump: LogprobDump, path: str, *, title: str | None = None) -> int:
    """Histogram PNG of the per-token log-ratios ``l_t`` (valid tokens of finite sequences); returns
    the number of tokens plotted. matplotlib's Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tok = _distributions(dump)["token log-ratio"].double().numpy()
    fig, ax = plt.subplots(figsize=(7, 4))
    if tok.size:
        ax.hist(tok, bins=100, color="#3b6ea8")
        ax.set_yscale("log")
    for x in (math.log(0.5), math.log(2.0)):
        ax.axvline(x, color="#c44e52", linestyle="--", linewidth=1)
    ax.set_xlabel("per-token log-ratio  l = log pi_train - log pi_rollout")
    ax.set_ylabel("tokens (log scale)")
    ax.set_title(title or f"{tok.size} tokens; dashed: r = 0.5 and r = 2")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return int(tok.size)
