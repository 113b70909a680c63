"""Malformed input to ``slime-tis diagnose``: one line naming the file, the record
(line) and the field, exit status 2, no traceback; nothing silently accepted; sizes checked before
anything is allocated; a torn final line tolerated and reported; an empty domain said so; quantiles of
more than 2**24 values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _one_line_error import assert_one_line_error

from slime_tis.cli import main as cli_main
from slime_tis.tools.diagnose import diagnose, quantiles
from slime_tis.tools.dump import DumpFormatError, read_logprob_dump, write_logprob_dump

GOOD = {"train_log_probs": [-0.5, -1.0, -0.25], "rollout_log_probs": [-0.4, -1.1, -0.3], "loss_mask": [1, 1, 0],
        "step": 0, "token_ids": [3, 4, 5], "reward": 1.0}
HEADER = {"format": "slime_tis.logprob_dump", "version": 1}


def _jsonl(tmp_path: Path, *lines: str, name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _rec(**changes) -> str:
    rec = {**GOOD, **changes}
    return json.dumps({k: v for k, v in rec.items() if v is not ...})


def _one_line_error(capsys, argv: list[str], *needles: str) -> str:
    """``slime-tis ARGV`` fails with exit status 2 and one stderr line holding every needle."""
    return assert_one_line_error(capsys, cli_main, argv, *needles)


# ------------------------------------------------------------------ .jsonl dumps
JSONL_CASES = {
    # name: (second line of the file, words the error must hold)
    "array line": ("[1, 2, 3]", ["d.jsonl:3", "expected a JSON object, got list"]),
    "string log-probs": (_rec(train_log_probs="abc"), ["d.jsonl:3", "record 1", "train_log_probs must be a list"]),
    "string log-prob value": (_rec(rollout_log_probs=[-0.4, "-1.1", -0.3]), ["d.jsonl:3", "rollout_log_probs[1]"]),
    "nested log-prob value": (_rec(train_log_probs=[-0.5, [-1.0], -0.25]), ["d.jsonl:3", "train_log_probs[1]"]),
    "step 1e400": (_rec().replace('"step": 0', '"step": 1e400'), ["d.jsonl:3", "step must be an integer"]),
    "step 2.5": (_rec(step=2.5), ["d.jsonl:3", "step must be an integer, got 2.5"]),
    "step true": (_rec(step=True), ["d.jsonl:3", "step must be an integer, got bool"]),
    "sample_index string": (_rec(sample_index="7"), ["d.jsonl:3", "sample_index must be an integer"]),
    "short loss_mask": (_rec(loss_mask=[1, 1]), ["d.jsonl:3", "loss_mask has 2 entries"]),
    "long token_ids": (_rec(token_ids=[1, 2, 3, 4]), ["d.jsonl:3", "token_ids has 4 entries"]),
    "string mask": (_rec(loss_mask=["1", "0", "0"]), ["d.jsonl:3", "loss_mask[0] must be 0 or 1, got str"]),
    "mask 2": (_rec(loss_mask=[1, 2, 1]), ["d.jsonl:3", "loss_mask[1] must be 0 or 1"]),
    "float token id": (_rec(token_ids=[3, 4.5, 5]), ["d.jsonl:3", "token_ids[1] must be an integer, got 4.5"]),
    "huge token id": (_rec(token_ids=[3, 10**30, 5]), ["d.jsonl:3", "token_ids[1]", "outside [0, 2**63)"]),
    "negative token id": (_rec(token_ids=[3, -4, 5]), ["d.jsonl:3", "token_ids[1] = -4"]),
    "string reward": (_rec(reward="high"), ["d.jsonl:3", "reward must be a number"]),
    "missing field": (_rec(rollout_log_probs=...), ["d.jsonl:3", "has no 'rollout_log_probs'"]),
    "bad version": (json.dumps({**HEADER, "version": "x"}), ["d.jsonl:3", "'version' must be an integer"]),
    "deep nesting": ("[" * 100_000 + "]" * 100_000, ["d.jsonl:3", "nested too deeply"]),
    "middle line cut": (_rec()[:30], ["d.jsonl:3", "not valid JSON"]),
}


@pytest.mark.parametrize("case", list(JSONL_CASES))
def test_malformed_jsonl_is_one_line_naming_file_line_and_field(case, tmp_path, capsys):
    bad, needles = JSONL_CASES[case]
    path = _jsonl(tmp_path, json.dumps(HEADER), _rec(), bad, _rec())
    _one_line_error(capsys, ["diagnose", str(path), "--no-png"], *needles)
    with pytest.raises(DumpFormatError):
        read_logprob_dump(path)


def test_not_a_file_and_not_utf8(tmp_path, capsys):
    (tmp_path / "dir.jsonl").mkdir()
    _one_line_error(capsys, ["diagnose", str(tmp_path / "dir.jsonl"), "--no-png"], "dir.jsonl", "is a directory")
    (tmp_path / "dir.pt").mkdir()
    _one_line_error(capsys, ["diagnose", str(tmp_path / "dir.pt"), "--no-png"], "dir.pt", "is a directory")
    path = tmp_path / "b.jsonl"
    path.write_bytes(_rec().encode() + b"\n" + b'{"train_log_probs": [\xff]}\n' + _rec().encode() + b"\n")
    _one_line_error(capsys, ["diagnose", str(path), "--no-png"], "b.jsonl:2", "not UTF-8")


def test_torn_final_line_is_dropped_and_reported(tmp_path, capsys):
    """A crash while appending leaves half a record (no newline): the reader keeps the complete records,
    says what it dropped, and ``diagnose`` still runs. The same text with a newline is a real error."""
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(HEADER) + "\n" + _rec() + "\n" + _rec(step=1) + "\n" + _rec(step=2)[:41])
    dump = read_logprob_dump(path)
    assert dump.n_seq == 2 and dump.step.tolist() == [0, 1]
    assert len(dump.notes) == 1 and "t.jsonl:4: the last line is incomplete" in dump.notes[0]
    assert cli_main(["diagnose", str(path), "--no-png"]) == 0
    captured = capsys.readouterr()
    assert "note: " in captured.err and "t.jsonl:4" in captured.err and "2 sequences" in captured.out
    path.write_text(path.read_text() + "\n")  # completed by a newline: no longer a torn tail, an error
    with pytest.raises(DumpFormatError, match=r"t.jsonl:4: not valid JSON"):
        read_logprob_dump(path)


# ------------------------------------------------------------------ .pt dumps
def _pt(tmp_path: Path, name: str = "d.pt", **changes) -> Path:
    obj = {
        "format": "slime_tis.logprob_dump", "version": 1,
        "train_log_probs": torch.tensor([-0.5, -1.0, -0.25, -2.0]),
        "rollout_log_probs": torch.tensor([-0.4, -1.1, -0.3, -2.0]),
        "loss_mask": torch.tensor([True, True, False, True]), "cu_seqlens": torch.tensor([0, 3, 4]),
        "step": torch.tensor([0, 1]), "sample_index": torch.tensor([0, 1]), "token_ids": None, "reward": None,
        "meta": {"writer": "test"},
    }
    obj.update(changes)
    path = tmp_path / name
    torch.save(obj, path)
    return path


PT_CASES = {
    "list for a tensor": (dict(train_log_probs=[-0.5, -1.0, -0.25, -2.0]), ["train_log_probs", "must be a 1-D tensor"]),
    "empty cu_seqlens": (dict(cu_seqlens=torch.zeros(0, dtype=torch.int64)), ["cu_seqlens", "is empty"]),
    "float cu_seqlens": (dict(cu_seqlens=torch.tensor([0.0, 2.5, 4.0])), ["cu_seqlens", "integer tensor"]),
    "decreasing cu_seqlens": (dict(cu_seqlens=torch.tensor([0, 3, 2, 4]), step=None, sample_index=None),
                              ["cu_seqlens", "decreases"]),
    "cu_seqlens past the tokens": (dict(cu_seqlens=torch.tensor([0, 3, 9])), ["cu_seqlens", "ends at 9"]),
    "meta = 5": (dict(meta=5), ["'meta' must be a dict"]),
    "step of wrong length": (dict(step=torch.tensor([0, 1, 2])), ["'step' has 3 entries, expected 2"]),
    "reward of wrong length": (dict(reward=torch.tensor([1.0])), ["'reward' has 1 entries, expected 2"]),
    "token_ids float": (dict(token_ids=torch.tensor([1.0, 2.0, 3.0, 4.0])), ["token_ids", "integer tensor"]),
    "string mask": (dict(loss_mask=["1", "0", "1", "1"]), ["loss_mask", "must be a 1-D tensor"]),
    "mask 0.5": (dict(loss_mask=torch.tensor([1.0, 0.5, 1.0, 1.0])), ["loss_mask", "only 0 and 1"]),
    "2-D log-probs": (dict(train_log_probs=torch.zeros(2, 2)), ["train_log_probs", "shape [2, 2]"]),
    "rollout shorter": (dict(rollout_log_probs=torch.zeros(3)), ["rollout_log_probs", "has 3 entries, expected 4"]),
    "version string": (dict(version="2"), ["'version' must be an integer"]),
    # the bounds of the JSONL reader: token ids >= 0, step and sample_index >= -1 (-1: absent)
    "negative token id": (dict(token_ids=torch.tensor([3, 4, 5, -7])), ["record 1: token_ids[0] = -7 is below 0"]),
    "negative token id int8": (dict(token_ids=torch.tensor([3, -1, 5, 6], dtype=torch.int8)),
                               ["record 0: token_ids[1] = -1 is below 0"]),
    "step -2": (dict(step=torch.tensor([0, -2])), ["record 1: step = -2 is below -1"]),
    "sample_index -5": (dict(sample_index=torch.tensor([-5, 1])), ["record 0: sample_index = -5 is below -1"]),
    # a 1.5 KB file whose tensors claim 16M tokens (stride-0 views): refused before anything is allocated
    "16M tokens in a small file": (
        dict(train_log_probs=torch.zeros(1).expand(1 << 24), rollout_log_probs=torch.zeros(1).expand(1 << 24),
             loss_mask=torch.ones(1, dtype=torch.bool).expand(1 << 24), cu_seqlens=torch.tensor([0, 1 << 24]),
             step=None, sample_index=None),
        ["claims 16777216 elements", "an expanded or overlapping view"]),
}


@pytest.mark.parametrize("case", list(PT_CASES))
def test_malformed_pt_is_one_line_naming_file_and_field(case, tmp_path, capsys):
    changes, needles = PT_CASES[case]
    path = _pt(tmp_path, **changes)
    _one_line_error(capsys, ["diagnose", str(path), "--no-png"], "d.pt", *needles)


@pytest.mark.timeout(60)
def test_two_to_the_31_claim_is_refused_before_allocating(tmp_path, capsys):
    """2**31 tokens claimed by a 1.5 KB file: converting them would allocate ~17 GB (run only on the fixed
    code: the old reader does allocate)."""
    big = 1 << 31
    path = _pt(tmp_path, train_log_probs=torch.zeros(1).expand(big), rollout_log_probs=torch.zeros(1).expand(big),
               loss_mask=torch.ones(1, dtype=torch.bool).expand(big), cu_seqlens=torch.tensor([0, big]),
               step=None, sample_index=None)
    assert path.stat().st_size < 4096
    _one_line_error(capsys, ["diagnose", str(path), "--no-png"], "d.pt", "claims 2147483648 elements")


def test_valid_pt_still_reads(tmp_path):
    dump = read_logprob_dump(_pt(tmp_path, cu_seqlens=torch.tensor([0, 3, 4], dtype=torch.int32)))
    assert dump.n_seq == 2 and dump.cu_seqlens.dtype == torch.int64 and dump.loss_mask.tolist() == [1, 1, 0, 1]


# ------------------------------------------------------------------ slime --save-debug-train-data dumps
def _slime(tmp_path: Path, **sample_changes) -> Path:
    sample = {"sample_index": 0, "tokens": torch.tensor([1, 2, 3, 4, 5]), "response_lengths": 3,
              "loss_masks": [1, 1, 1], "rollout_log_probs": torch.tensor([-0.4, -1.1, -0.3]),
              "log_probs": torch.tensor([-0.5, -1.0, -0.25]), "rewards": 1.0}
    sample.update(sample_changes)
    path = tmp_path / "train_0.pt"
    torch.save({"format_version": 2, "rollout_id": sample_changes.pop("_rollout_id", 0), "rank": 0,
                "samples": [sample]}, path)
    return path


SLIME_CASES = {
    "log_probs a string": (dict(log_probs="abc"), ["rollout 0, sample 0", "'log_probs' must be a list"]),
    "log_probs strings": (dict(log_probs=["a", "b", "c"]), ["rollout 0, sample 0", "'log_probs' must hold numbers"]),
    "nested tokens": (dict(tokens=[[1], [2], [3]]), ["rollout 0, sample 0", "'tokens' must hold integers"]),
    "float tokens": (dict(tokens=torch.tensor([1.0, 2.0, 3.0])), ["sample 0", "'tokens' must be an integer tensor"]),
    "string sample_index": (dict(sample_index="x"), ["sample 0", "'sample_index' must be an integer"]),
    "string loss_masks": (dict(loss_masks=["1", "1", "1"]), ["rollout 0, sample 0", "'loss_masks' must hold numbers"]),
    "loss_masks 2": (dict(loss_masks=[1, 2, 1]), ["train_0.pt: rollout 0, sample 0: loss_mask[1] must be 0 or 1"]),
    "2-D log_probs": (dict(log_probs=torch.zeros(3, 1)), ["sample 0", "'log_probs' must be 1-D"]),
    "expanded tokens": (dict(tokens=torch.zeros(1, dtype=torch.int64).expand(1 << 24)), ["claims 16777216"]),
}


@pytest.mark.parametrize("case", list(SLIME_CASES))
def test_malformed_slime_dump_is_one_line(case, tmp_path, capsys):
    changes, needles = SLIME_CASES[case]
    _one_line_error(capsys, ["diagnose", str(_slime(tmp_path, **changes)), "--no-png"], "train_0.pt", *needles)


def test_slime_dump_bad_rollout_id(tmp_path, capsys):
    path = tmp_path / "train_x.pt"
    torch.save({"format_version": 2, "rollout_id": "abc", "samples": []}, path)
    _one_line_error(capsys, ["diagnose", str(path), "--no-png"], "train_x.pt", "'rollout_id' must be an integer")


# ------------------------------------------------------------------ empty domain, big domains
@pytest.mark.parametrize("kind", ["all masked", "all non-finite"])
def test_no_usable_token_is_said_not_called_negligible(kind, tmp_path, capsys):
    recs = []
    for i in range(4):
        rec = {**GOOD, "step": i}
        if kind == "all masked":
            rec["loss_mask"] = [0, 0, 0]
        else:
            rec["train_log_probs"] = [-0.5, float("nan"), -0.25]
        recs.append(rec)
    path = tmp_path / "e.jsonl"
    write_logprob_dump(path, recs)
    d = diagnose(read_logprob_dump(path))
    assert d.usable_tokens == 0 and d.recommendation.fields == {}
    assert "no usable token" in d.recommendation.reasons[0]
    assert cli_main(["diagnose", str(path), "--no-png"]) == 1
    out = capsys.readouterr().out
    assert "no usable token" in out and "negligible" not in out and "batch-normalise" not in out


def test_quantiles_match_torch_and_scale_past_two_to_the_24():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1001, generator=g)
    qs = [0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99, 1.0]
    ref = torch.quantile(x.double(), torch.tensor(qs, dtype=torch.float64)).tolist()
    # float64 interpolation between the same two order statistics: equal to a few ulps
    assert quantiles(x, qs) == pytest.approx(ref, rel=1e-12, abs=1e-12)
    assert all(math.isnan(v) for v in quantiles(torch.zeros(0), qs))
    n = (1 << 24) + 3  # torch.quantile refuses inputs larger than 2**24
    big = torch.arange(n, dtype=torch.float32).flip(0)
    assert quantiles(big, [0.0, 0.5, 1.0]) == [0.0, (n - 1) / 2, float(n - 1)]
