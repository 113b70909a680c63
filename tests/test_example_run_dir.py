"""The example's run directory: one run per directory, resumed only with its own configuration; torn last
lines of its logs survive a resume; checkpoints carry checksums that are verified before loading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from examples.rl.ckpt_manifest import MANIFEST, CheckpointIntegrityError, verify_manifest, write_manifest  # noqa: E402
from examples.rl.run_dir import RunDirError, clear, cut_from_step, write_saved  # noqa: E402
from examples.rl.train import build_parser, resolve_args  # noqa: E402


def _saved_run(path: Path, argv: list[str], *, algorithm: int) -> Path:
    """A run directory as the trainer leaves it after its checkpoint of step 2 (args.json, a hand-made
    checkpoint directory with its manifest, latest)."""
    step = path / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "metadata.json").write_text("{}")
    (step / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    write_manifest(str(step))
    (path / "checkpoints" / "latest").write_text("2")
    write_saved(str(path), build_parser().parse_args(["--run-dir", str(path), *argv]),
                {"algorithm": algorithm, "world_size": 1})
    return path


# ------------------------------------------------------------------ fresh start
def test_fresh_start_refuses_a_non_empty_run_dir(tmp_path):
    run = _saved_run(tmp_path / "run", ["--use-tis"], algorithm=2)
    with pytest.raises(RunDirError, match="is not empty .*--resume.*--overwrite"):
        resolve_args(["--run-dir", str(run)])
    assert resolve_args(["--run-dir", str(run), "--overwrite"]).overwrite
    clear(str(run))
    assert os.listdir(run) == [] and resolve_args(["--run-dir", str(run)]).run_dir == str(run)
    assert resolve_args(["--run-dir", str(tmp_path / "new")]).run_dir == str(tmp_path / "new")


def test_overwrite_never_empties_a_directory_that_is_not_a_run_dir(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="has no args.json, so it is not a run directory"):
        resolve_args(["--run-dir", str(tmp_path), "--overwrite"])
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="exists and is not a directory"):
        resolve_args(["--run-dir", str(tmp_path / "file")])
    with pytest.raises(RunDirError, match="give one of them"):
        resolve_args(["--run-dir", str(tmp_path), "--overwrite", "--resume"])


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` with its bytes (files), link target (symlinks) or "dir"."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else ("dir" if p.is_dir() else p.read_bytes())
    return out


@pytest.mark.parametrize("case", ["other_tool", "not_json", "list", "old_format", "symlink", "deep", "dir"])
def test_overwrite_refuses_an_args_json_this_job_did_not_write(tmp_path, case):
    """Another tool's args.json (or a garbled one, or a run directory of an older format) does not make a
    directory deletable: --overwrite refuses in one line and every byte stays."""
    d = tmp_path / "theirs"
    (d / "data").mkdir(parents=True)
    (d / "data" / "model.bin").write_bytes(b"\0" * 64)
    (d / "notes.txt").write_text("mine")
    marked = _saved_run(tmp_path / "ours", ["--use-tis"], algorithm=2) / "args.json"
    content = {
        "other_tool": json.dumps({"lr": 0.1, "epochs": 3}),
        "not_json": "lr=0.1\n",
        "list": json.dumps([{"run_dir_format": "examples.rl.train run directory, format 1"}]),
        "old_format": json.dumps({k: v for k, v in json.loads(marked.read_text()).items() if k != "run_dir_format"}),
        "deep": "[" * 100_000,
    }
    if case == "symlink":  # a link to a marked args.json elsewhere does not mark this directory
        (d / "args.json").symlink_to(marked)
    elif case == "dir":
        (d / "args.json").mkdir()
    else:
        (d / "args.json").write_text(content[case])
    before = _tree(d)
    with pytest.raises(RunDirError, match="not a run directory written by this job; nothing was deleted") as e:
        resolve_args(["--run-dir", str(d), "--overwrite"])
    assert "\n" not in str(e.value)
    assert _tree(d) == before
    # the trainer's entry point: one line on stderr, exit 2, nothing deleted
    from examples.rl.train import main

    assert main(["--run-dir", str(d), "--overwrite"]) == 2
    assert _tree(d) == before


def test_overwrite_empties_a_run_dir_this_job_wrote(tmp_path):
    run = _saved_run(tmp_path / "run", ["--use-tis"], algorithm=2)
    saved = json.loads((run / "args.json").read_text())
    assert saved["run_dir_format"] == "examples.rl.train run directory, format 1"
    assert resolve_args(["--run-dir", str(run), "--overwrite"]).overwrite
    assert resolve_args(["--run-dir", str(run), "--resume"]).use_tis  # the marker is no flag


# ------------------------------------------------------------------ resume takes the saved configuration
def test_resume_takes_the_saved_configuration(tmp_path):
    run = _saved_run(tmp_path / "run", ["--use-tis", "--tis-mode", "clip", "--lr", "0.01", "--seed", "3",
                                        "--steps", "4", "--pp", "2"], algorithm=2)
    args = resolve_args(["--run-dir", str(run), "--resume"])  # no flags: an algorithm-2 run stays algorithm 2
    assert (args.use_tis, args.tis_mode, args.lr, args.seed, args.steps, args.pp) == (True, "clip", 0.01, 3, 4, 2)
    args = resolve_args(["--run-dir", str(run), "--resume", "--use-tis", "--lr", "0.01", "--steps", "9", "--pp", "1"])
    assert (args.steps, args.pp, args.lr) == (9, 1, 0.01)  # the flags that may change, changed


@pytest.mark.parametrize("flags,words", [
    (["--lr", "0.02"], "--lr: the run has 0.01, this command line 0.02"),
    (["--tis-mode", "mask"], "--tis-mode 'mask' change the run's configuration (mode 'clip' -> 'mask'"),
    (["--use-rollout-log-probs"], "the run is algorithm 2, this command line gives algorithm 3"),
    (["--sglang-url", "http://127.0.0.1:1"], "--sglang-url: the run used the embedded engine"),
    (["--engine-dtype", "float32"], "--engine-dtype: the run has 'bfloat16', this command line 'float32'"),
])
def test_resume_refuses_contradicting_flags(tmp_path, flags, words):
    run = _saved_run(tmp_path / "run", ["--use-tis", "--tis-mode", "clip", "--lr", "0.01"], algorithm=2)
    before = (run / "args.json").read_bytes()
    with pytest.raises(RunDirError, match="contradicts the run's args.json") as e:
        resolve_args(["--run-dir", str(run), "--resume", *flags])
    assert words in str(e.value)
    assert (run / "args.json").read_bytes() == before


def test_resume_accepts_another_spelling_of_the_same_plugin_configuration(tmp_path):
    run = _saved_run(tmp_path / "run", ["--tis-preset", "decoupled_seq_is"], algorithm=2)
    args = resolve_args(["--run-dir", str(run), "--resume", "--use-tis", "--tis-level", "sequence"])
    assert args.tis_preset == "decoupled_seq_is"
    with pytest.raises(RunDirError, match="level 'sequence' -> 'token'"):
        resolve_args(["--run-dir", str(run), "--resume", "--tis-level", "token"])


def test_resume_needs_args_json_and_a_checkpoint(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("1")
    with pytest.raises(RunDirError, match="args.json does not exist"):
        resolve_args(["--run-dir", str(tmp_path), "--resume"])
    (tmp_path / "args.json").write_text("[1]")
    with pytest.raises(RunDirError, match="must hold a JSON object"):
        resolve_args(["--run-dir", str(tmp_path), "--resume"])
    run = _saved_run(tmp_path / "run", [], algorithm=0)
    (run / "checkpoints" / "latest").unlink()
    with pytest.raises(RunDirError, match="checkpoints/latest does not exist"):
        resolve_args(["--run-dir", str(run), "--resume"])


# ------------------------------------------------------------------ torn last lines and repeated steps
def test_cut_from_step_drops_repeated_steps_and_a_torn_tail(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [{"format": "x"}, {"step": 0}, {"step": 1}, {"format": "x"}, {"step": 2}, {"step": 3}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "rew')
    notes = cut_from_step(str(path), 2)
    assert len(notes) == 1 and "m.jsonl:7: the last line is incomplete" in notes[0]
    assert path.read_text() == "".join(json.dumps(r) + "\n" for r in rows[:4])
    path.write_text('{"step": 0}\n{"step": 1}')  # complete record, only the newline missing: kept
    assert cut_from_step(str(path), 5) == [] and path.read_text() == '{"step": 0}\n{"step": 1}\n'
    path.write_text('{"step": 0}\n{"step": 1, "x\n{"step": 2}\n')  # broken in the middle: an error
    with pytest.raises(ValueError, match="m.jsonl:2: not valid JSON"):
        cut_from_step(str(path), 1)


# ------------------------------------------------------------------ checkpoint manifests
def test_manifest_detects_every_kind_of_change(tmp_path):
    ckpt = tmp_path / "step_000001"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "a.distcp").write_bytes(bytes(range(256)) * 40)
    (ckpt / ".metadata").write_bytes(b"meta")
    (ckpt / "sub" / "b.pt").write_bytes(b"b" * 100)
    write_manifest(str(ckpt))
    verify_manifest(str(ckpt))
    assert "sub/b.pt" in (ckpt / MANIFEST).read_text()

    data = bytearray((ckpt / "a.distcp").read_bytes())
    data[5000] ^= 0x01  # one flipped mantissa bit
    (ckpt / "a.distcp").write_bytes(bytes(data))
    with pytest.raises(CheckpointIntegrityError, match=r"a\.distcp is corrupt: sha256"):
        verify_manifest(str(ckpt))
    data[5000] ^= 0x01
    (ckpt / "a.distcp").write_bytes(bytes(data))
    verify_manifest(str(ckpt))
    (ckpt / "sub" / "b.pt").unlink()
    with pytest.raises(CheckpointIntegrityError, match=r"sub/b\.pt is missing"):
        verify_manifest(str(ckpt))
    (ckpt / "sub" / "b.pt").write_bytes(b"b" * 100)
    (ckpt / "planted.pt").write_bytes(b"x")
    with pytest.raises(CheckpointIntegrityError, match=r"planted\.pt is not listed"):
        verify_manifest(str(ckpt))
    (ckpt / "planted.pt").unlink()
    (ckpt / MANIFEST).write_text("zz  ../../etc/passwd\n")
    with pytest.raises(CheckpointIntegrityError, match="not a '<sha256>  <relative path>' line"):
        verify_manifest(str(ckpt))
    (ckpt / MANIFEST).unlink()
    with pytest.raises(CheckpointIntegrityError, match="has no manifest.sha256"):
        verify_manifest(str(ckpt))


# ------------------------------------------------------------------ refusals in one line, before anything is built
def _resumable(run: Path) -> Path:
    """A run directory that resumes from step 2; returns its checkpoint's weights file."""
    return _saved_run(run, ["--use-tis"], algorithm=2) / "checkpoints" / "step_000002" / "__0_0.distcp"


@pytest.fixture
def no_dist(monkeypatch):
    """Starting the process group (or building anything) fails the test: refusals come before it."""
    import examples.rl.dist as dist

    def boom(**_):
        raise AssertionError("init_distributed reached")

    monkeypatch.setattr(dist, "init_distributed", boom)


def test_corrupt_checkpoint_is_refused_in_one_line_at_start(tmp_path, capsys, no_dist):
    from _one_line_error import assert_one_line_error

    from examples.rl.train import main

    weights = _resumable(tmp_path / "run")
    data = bytearray(weights.read_bytes())
    data[1000] ^= 0x40
    weights.write_bytes(bytes(data))
    assert_one_line_error(capsys, main, ["--run-dir", str(tmp_path / "run"), "--resume"],
                          "examples.rl.train: error:", f"checkpoint file {weights} is corrupt")
    (weights.parent / "metadata.json").unlink()
    assert_one_line_error(capsys, main, ["--run-dir", str(tmp_path / "run"), "--resume"],
                          "no dist checkpoint at", "step_000002 (metadata.json missing)")


@pytest.mark.parametrize("content", [b"abc", b"", b"2\x00\xff", b"-1", b"0", b"1e3", b"9" * 40, b"\xff\xfe"])
def test_garbled_latest_is_refused_naming_the_file(tmp_path, capsys, no_dist, content):
    from _one_line_error import assert_one_line_error

    from examples.rl.train import main

    _resumable(tmp_path / "run")
    latest = tmp_path / "run" / "checkpoints" / "latest"
    latest.write_bytes(content)
    assert_one_line_error(capsys, main, ["--run-dir", str(tmp_path / "run"), "--resume"],
                          f"{latest} holds", "not the step number of a checkpoint")


def test_unsupported_torch_is_refused_at_argument_parsing(tmp_path, capsys, monkeypatch, no_dist):
    """The torch seen is made 2.15's (``TensorProperties`` with ``strides``, the version string): the example
    refuses in one line before the process group or the model exists."""
    import dataclasses

    import torch
    import torch.distributed.checkpoint.metadata as metadata
    from _one_line_error import assert_one_line_error

    from examples.rl.train import main

    @dataclasses.dataclass
    class TensorPropertiesWithStrides(metadata.TensorProperties):
        strides: tuple = ()

    monkeypatch.setattr(metadata, "TensorProperties", TensorPropertiesWithStrides)
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    assert_one_line_error(capsys, main, ["--run-dir", str(tmp_path / "run")],
                          "examples.rl.train: error: torch 2.15.0:", "torch < 2.15")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ the launcher end to end
TINY = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "2", "--num-microbatches", "1",
        "--save-interval", "1", "--dump-interval", "1", "--no-progress"]


def _train(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "examples.rl.train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if '"step"' in line]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_launcher_run_dir_lifecycle(tmp_path):
    """An algorithm-2 run of 2 steps crashes while logging step 1 (torn last lines, checkpoint of step 1
    only); ``--resume`` alone continues it as algorithm 2, keeps args.json, repeats step 1 once in both
    logs. A new run in the same directory is refused; a corrupted checkpoint is refused naming the file."""
    run = tmp_path / "run"
    first = _train(["--run-dir", str(run), "--use-tis", "--tis-mode", "clip", *TINY])
    assert first.returncode == 0, first.stderr[-3000:]
    args_json = (run / "args.json").read_bytes()
    assert json.loads(args_json)["algorithm"] == 2

    # the crash: step 1 logged (then torn lines appended), its checkpoint never published
    (run / "checkpoints" / "latest").write_text("1")
    for name in ("metrics.jsonl", "logprobs.jsonl"):
        with open(run / name, "a", encoding="utf-8") as f:
            f.write('{"step": 2, "train_log_probs": [-0.5, -0.')
    again = _train(["--run-dir", str(run), "--resume", "--no-progress"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert (run / "args.json").read_bytes() == args_json  # never rewritten by a resume
    assert _steps(run / "metrics.jsonl") == [0, 1]
    from slime_tis.tools.dump import read_logprob_dump

    dump = read_logprob_dump(run / "logprobs.jsonl")
    assert dump.notes == [] and dump.step.tolist() == [0] * 8 + [1] * 8  # each step once, no torn line left
    assert dump.meta["algorithm"] == 2

    fresh = _train(["--run-dir", str(run), *TINY])  # without --resume: refused, nothing touched
    assert fresh.returncode == 2 and "is not empty" in fresh.stderr and "Traceback" not in fresh.stderr
    assert _steps(run / "metrics.jsonl") == [0, 1]

    latest = int((run / "checkpoints" / "latest").read_text())
    assert latest == 2  # the resumed run saved step 2 again
    distcp = sorted((run / "checkpoints" / f"step_{latest:06d}").glob("*.distcp"))[0]
    data = bytearray(distcp.read_bytes())
    data[len(data) // 2] ^= 0x40  # a corrupted mantissa byte in the middle of the weights
    distcp.write_bytes(bytes(data))
    broken = _train(["--run-dir", str(run), "--resume", "--no-progress"])
    assert broken.returncode != 0
    assert f"checkpoint file {distcp} is corrupt" in broken.stderr
