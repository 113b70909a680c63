"""``slime-tis diagnose`` on slime's own debug dumps (``--save-debug-train-data`` files).

The files are built the way slime writes them (THUDM/slime 624b824):

* ``slime/observability/train_data_utils.py`` (``--save-debug-train-data``, since 681b3ad): the writer
  (last pipeline stage, tensor rank 0, context rank 0, data-parallel source rank) gathers every
  data-parallel rank's ``rollout_data`` (columns of per-sample values, context-parallel fields restored
  to full responses), turns them into one dict per sample -- ``data_parallel_rank``, ``sample_index``
  (from ``sample_indices``), ``rollout_position`` (from ``partition``) and every per-sample column --
  sorted by ``rollout_position``, and ``torch.save``s ``{"format_version": 2, "rollout_id", "rank",
  "samples", "dp_shards", **whole-batch fields}``; ``dp_shards`` keeps the non-per-sample layout;
* before 681b3ad (``slime/utils/train_dump_utils.py``): every rank saved ``{"rollout_id", "rank",
  "rollout_data"}`` with its own (context-parallel-local) columns;
* ``slime/observability/rollout_data_utils.py`` (``--save-debug-rollout-data``): ``{"rollout_id",
  "samples": [Sample.to_dict()]}`` (``slime/utils/types.py``).

``train_dump_v2`` was checked equal (every key, every tensor) to the payload of slime 624b824's own
``_build_dump_payload`` for the same shards, and the reader was run on files written by slime's
``_build_dump_payload`` + ``torch.save`` and ``save_debug_rollout_data`` with real ``Sample`` objects.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from slime_tis import TISConfig, compute_tis
from slime_tis.cli import main as cli_main
from slime_tis.tools.dump import read_logprob_dump

PROMPT = 3


def make_samples(seed: int, n: int, rollout_id: int):
    """Per-sample values of one rollout, with global rollout positions 0..n-1."""
    g = torch.Generator().manual_seed(seed + 1000 * rollout_id)
    out = []
    for pos in range(n):
        r = int(torch.randint(3, 9, (1,), generator=g))
        lp = -torch.rand(r, generator=g)
        rl = lp + 0.1 * torch.randn(r, generator=g)
        mask = torch.ones(r, dtype=torch.int32)
        mask[0] = 0
        tokens = torch.randint(0, 500, (PROMPT + r,), generator=g)
        out.append({"pos": pos, "tokens": tokens, "total_lengths": PROMPT + r, "response_lengths": r,
                    "loss_masks": mask, "rollout_log_probs": rl, "log_probs": lp,
                    "advantages": torch.full((r,), 0.5), "rewards": float(pos % 2)})
    return out


def rollout_data(samples, *, with_log_probs=True):
    """One data-parallel rank's ``rollout_data`` columns (as the actor holds them before the dump)."""
    cols = {k: [s[k] for s in samples] for k in ("tokens", "total_lengths", "response_lengths", "loss_masks",
                                                "rollout_log_probs", "advantages", "rewards")}
    if with_log_probs:
        cols["log_probs"] = [s["log_probs"] for s in samples]
    cols["sample_indices"] = [100 + s["pos"] for s in samples]
    cols["partition"] = [s["pos"] for s in samples]
    cols["micro_batch_indices"] = [[list(range(len(samples)))]]
    cols["num_microbatches"] = [1]
    return cols


def train_dump_v2(rollout_id, shards, *, writer_rank=0, with_log_probs=True):
    """The payload slime's format-version-2 writer saves, from DP shards ``[(rank, dp_rank, samples)]``."""
    samples, layout = [], []
    for rank, dp_rank, local in shards:
        cols = rollout_data(local, with_log_probs=with_log_probs)
        entry = {"rank": rank, "data_parallel_rank": dp_rank, "sample_indices": cols.pop("sample_indices"),
                 "partition": cols.pop("partition")}
        entry["micro_batch_indices"] = cols.pop("micro_batch_indices")
        entry["num_microbatches"] = cols.pop("num_microbatches")
        layout.append(entry)
        for i in range(len(local)):
            sample = {"data_parallel_rank": dp_rank, "sample_index": entry["sample_indices"][i],
                      "rollout_position": entry["partition"][i]}
            sample.update({k: v[i] for k, v in cols.items()})
            samples.append(sample)
    samples.sort(key=lambda s: s["rollout_position"])
    return {"format_version": 2, "rollout_id": rollout_id, "rank": writer_rank, "samples": samples,
            "dp_shards": layout}


def expected(samples_by_rollout):
    """Packed arrays of the records slime_tis must read, in (rollout, sample_index) order."""
    recs = [(rid, s) for rid, ss in samples_by_rollout for s in ss]
    lp = torch.cat([s["log_probs"] for _, s in recs])
    rl = torch.cat([s["rollout_log_probs"] for _, s in recs])
    mask = torch.cat([s["loss_masks"] for _, s in recs]).bool()
    lengths = torch.tensor([s["response_lengths"] for _, s in recs])
    cu = torch.zeros(len(recs) + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    ids = torch.cat([s["tokens"][PROMPT:] for _, s in recs])
    return lp, rl, mask, cu, ids, [rid for rid, _ in recs], [100 + s["pos"] for _, s in recs]


def test_train_dump_v2_read_exactly(tmp_path):
    ss = make_samples(0, 6, rollout_id=3)
    payload = train_dump_v2(3, [(0, 0, ss[0::2]), (2, 1, ss[1::2])])  # DP = 2, interleaved positions
    torch.save(payload, tmp_path / "train_3.pt")
    d = read_logprob_dump(tmp_path / "train_3.pt")
    lp, rl, mask, cu, ids, steps, idx = expected([(3, ss)])
    assert torch.equal(d.train_log_probs, lp) and torch.equal(d.rollout_log_probs, rl)
    assert torch.equal(d.loss_mask, mask) and torch.equal(d.cu_seqlens, cu) and torch.equal(d.token_ids, ids)
    assert d.step.tolist() == steps and d.sample_index.tolist() == idx
    assert d.reward.tolist() == [float(i % 2) for i in range(6)]
    assert d.meta["writer"] == "slime --save-debug-train-data" and d.meta["rollouts"] == [3]


def test_cli_merges_several_files_of_one_rollout_and_several_rollouts(tmp_path, capsys):
    r3, r4 = make_samples(1, 4, rollout_id=3), make_samples(1, 5, rollout_id=4)
    torch.save(train_dump_v2(3, [(0, 0, r3[:2])]), tmp_path / "train_3_0.pt")  # one rollout in two files
    torch.save(train_dump_v2(3, [(4, 0, r3[1:])], writer_rank=4), tmp_path / "train_3_4.pt")  # r3[1] in both
    torch.save(train_dump_v2(4, [(0, 0, r4)]), tmp_path / "train_4.pt")
    js = tmp_path / "r.json"
    files = [str(tmp_path / f) for f in ("train_4.pt", "train_3_4.pt", "train_3_0.pt")]
    assert cli_main(["diagnose", *files, "--no-png", "--json", str(js)]) == 0, capsys.readouterr().err
    report = json.loads(js.read_text())
    assert report["n_seq"] == 9  # 4 + 5, the shared sample counted once
    lp, rl, mask, cu, *_ = expected([(3, r3), (4, r4)])
    ref = compute_tis(TISConfig(use_tis=True), lp, rl, mask, cu).stats.finalize()
    for k, v in ref.items():
        assert report["overall"][k] == pytest.approx(float(v), rel=1e-9, abs=1e-12), k
    d = read_logprob_dump(files)
    assert d.step.tolist() == [3] * 4 + [4] * 5 and d.sample_index.tolist() == [100, 101, 102, 103] + list(
        range(100, 105))
    # --steps selects rollouts
    assert cli_main(["diagnose", *files, "--no-png", "--steps", "4:", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["n_seq"] == 5
    # the directory stands for its train_*.pt files (the report's JSON file in it is no dump)
    js_dir = tmp_path / "from_dir.json"
    assert cli_main(["diagnose", str(tmp_path), "--no-png", "--json", str(js_dir)]) == 0, capsys.readouterr().err
    assert json.loads(js_dir.read_text())["overall"] == report["overall"]


def test_conflicting_copies_of_a_sample_are_an_error(tmp_path):
    ss = make_samples(2, 3, rollout_id=1)
    torch.save(train_dump_v2(1, [(0, 0, ss)]), tmp_path / "a.pt")
    other = [dict(s) for s in ss]
    other[2]["log_probs"] = other[2]["log_probs"] - 1.0
    torch.save(train_dump_v2(1, [(0, 0, other)]), tmp_path / "b.pt")
    with pytest.raises(ValueError, match=r"b\.pt: rollout 1 sample \(102,\) differs from the same sample in .*a\.pt"):
        read_logprob_dump([tmp_path / "a.pt", tmp_path / "b.pt"])


def test_legacy_per_rank_files_merged(tmp_path):
    """slime before 681b3ad: every rank saved its own rollout_data; TP ranks duplicate, the first pipeline
    stage has no log_probs, DP ranks hold disjoint samples."""
    ss = make_samples(3, 4, rollout_id=7)
    files = []
    for rank, local, with_lp in ((0, ss[:2], False), (1, ss[:2], True), (2, ss[:2], True), (3, ss[2:], True)):
        path = tmp_path / f"7_{rank}.pt"
        torch.save({"rollout_id": 7, "rank": rank, "rollout_data": rollout_data(local, with_log_probs=with_lp)}, path)
        files.append(path)
    d = read_logprob_dump(files)
    lp, rl, mask, cu, ids, *_ = expected([(7, ss)])
    assert d.n_seq == 4 and torch.equal(d.train_log_probs, lp) and torch.equal(d.cu_seqlens, cu)
    # context parallelism in a legacy dump: chunks, not responses -> refused with the way out
    cp = rollout_data(ss[:1])
    cp["log_probs"] = [cp["log_probs"][0][:2]]
    torch.save({"rollout_id": 8, "rank": 0, "rollout_data": cp}, tmp_path / "cp.pt")
    with pytest.raises(ValueError, match=r"context-parallel chunks .* slime >= 681b3ad"):
        read_logprob_dump(tmp_path / "cp.pt")


def rollout_only_dump(rollout_id, samples):
    """--save-debug-rollout-data: Sample.to_dict() of each sample (the main fields)."""
    out = []
    for s in samples:
        r = s["response_lengths"]
        out.append({"group_index": s["pos"] // 2, "index": 100 + s["pos"], "rollout_id": None, "prompt": "q",
                    "tokens": s["tokens"].tolist(), "multimodal_inputs": None, "response": "a", "response_length": r,
                    "label": "1", "reward": s["rewards"], "loss_mask": s["loss_masks"].tolist(),
                    "weight_versions": ["1"], "rollout_log_probs": s["rollout_log_probs"].tolist(),
                    "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None,
                    "rollout_routed_experts": None, "remove_sample": False, "teacher_log_probs": None,
                    "status": "completed", "metadata": {}, "train_metadata": None,
                    "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                                  "completion_token_num": 0},
                    "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": 0}})
    return {"rollout_id": rollout_id, "samples": out}


def test_rollout_only_dump_says_what_is_missing(tmp_path, capsys):
    torch.save(rollout_only_dump(5, make_samples(4, 3, rollout_id=5)), tmp_path / "rollout_5.pt")
    assert cli_main(["diagnose", str(tmp_path / "rollout_5.pt"), "--no-png"]) == 2
    err = capsys.readouterr().err
    for part in ("a slime --save-debug-rollout-data file (rollout 5, 3 samples, 3 with rollout_log_probs)",
                 "no training log-probs", "--save-debug-train-data DIR/train_{rollout_id}.pt",
                 "--load-debug-rollout-data"):
        assert part in err, err


def test_train_dump_without_training_logprobs_explains(tmp_path):
    payload = train_dump_v2(2, [(0, 0, make_samples(5, 2, rollout_id=2))], with_log_probs=False)
    torch.save(payload, tmp_path / "t.pt")
    with pytest.raises(ValueError, match=r"rollout 2 has no training log-probs .*custom loss"):
        read_logprob_dump(tmp_path / "t.pt")
    payload = train_dump_v2(2, [(0, 0, make_samples(5, 2, rollout_id=2))])
    for s in payload["samples"]:
        del s["rollout_log_probs"]
    torch.save(payload, tmp_path / "t.pt")
    with pytest.raises(ValueError, match="has no 'rollout_log_probs'"):
        read_logprob_dump(tmp_path / "t.pt")


def test_nan_in_slime_dump_is_counted_not_fatal(tmp_path):
    ss = make_samples(6, 4, rollout_id=0)
    ss[1]["rollout_log_probs"][-1] = math.nan
    torch.save(train_dump_v2(0, [(0, 0, ss)]), tmp_path / "t.pt")
    js = tmp_path / "r.json"
    assert cli_main(["diagnose", str(tmp_path / "t.pt"), "--no-png", "--json", str(js)]) == 0
    assert json.loads(js.read_text())["overall"]["tis/nonfinite_seq_fraction"] == pytest.approx(0.25)
