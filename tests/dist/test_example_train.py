"""The example RL job in real processes: torchrun with 2 processes for each algorithm (finite loss,
parameters change, bit-identical checkpoint resume), a 50-step run whose reward rises, a 2-"node"
c10d rendezvous on localhost, and the --sglang-url HTTP path against the embedded engine's server.

The 2-process runs of the selected tests are made by the module fixture ``runs`` in two torchrun launches (the
first runs, then the runs resumed from their checkpoints), each run in a fresh process forked from a worker that
imported megatron once (``_batch.py``); each test then checks its own runs."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _batch import Job, torchrun_batch
from _launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.dist, pytest.mark.slow]
TIMING_KEYS = ("rollout_time_s", "step_time_s")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _check(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _python_train(train_args: list[str], timeout: int = 240) -> None:
    cmd = [sys.executable, "-m", "examples.rl.train", "--no-progress", *train_args]
    _check(subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout))


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


TOOL = os.path.join(ROOT, "tests", "dist", "_example_ckpt_tool.py")


def _ckpts(*at: tuple) -> list[dict[str, torch.Tensor]]:
    """Every global tensor of the dist checkpoint of each ``(run_dir, step)`` (model and optimizer), flattened by
    key; one helper process reads them all."""
    pairs = []
    for run_dir, step in at:
        pairs += [os.path.join(str(run_dir), "checkpoints", f"step_{step:06d}"),
                  os.path.join(str(run_dir), f"plain_{step}.pt")]
    _check(
        subprocess.run(
            [sys.executable, TOOL, "plain", *pairs], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240
        )
    )
    return [torch.load(out, map_location="cpu", weights_only=True) for out in pairs[1::2]]


CASES = {
    "alg0-pp2": ["--pp", "2"],
    "alg1-dp2": ["--use-rollout-log-probs"],
    "alg2-pp2-lag1": ["--pp", "2", "--use-tis", "--rollout-lag", "1"],
    "alg3-dp2-seq-clip": ["--use-rollout-log-probs", "--use-tis", "--tis-level", "sequence", "--tis-mode", "clip"],
    "alg2-pp2-moe-replay": ["--pp", "2", "--use-tis", "--moe-experts", "4", "--routing-replay"],
}


RESUME_COMMON = ["--steps", "4", "--save-interval", "2", "--prompts-per-step", "8", "--group-size", "4",
                 "--dump-interval", "0"]
RESHARD_COMMON = ["--steps", "3", "--prompts-per-step", "8", "--group-size", "4", "--dump-interval", "0", "--use-tis"]
SPR_ARGS = ["--steps", "2", "--prompts-per-step", "8", "--group-size", "4", "--dump-interval", "0",
            "--steps-per-rollout", "2", "--ppo-epochs", "2", "--lr", "1e-2", "--pp", "2"]
FIFTY_ARGS = ["--steps", "50", "--use-tis", "--dump-interval", "25"]


def _train(name: str, run_dir: Path, args: list[str]) -> Job:
    return Job(name, ["-m", "examples.rl.train", "--no-progress", "--run-dir", str(run_dir), *args])


def _resume_from(src: Path, dst: Path, step: int) -> None:
    """``dst`` as a run directory holding ``src``'s checkpoint at ``step`` (and its saved configuration)."""
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / f"step_{step:06d}", dst / "checkpoints" / f"step_{step:06d}")
    (dst / "checkpoints" / "latest").write_text(str(step))
    shutil.copy(src / "args.json", dst / "args.json")  # a resumed run takes its saved configuration


class Runs:
    def __init__(self, root: Path, results: dict) -> None:
        self.root, self.results = root, results

    def dir(self, name: str) -> Path:
        """The run directory of the run ``name``, after checking that it succeeded on every rank."""
        res = self.results.get(name)
        assert res is not None, f"run {name} was not made (the run it resumes from failed: {self._failed()})"
        assert res.ok, res.failure()
        return self.root / name

    def _failed(self) -> list[str]:
        return [n for n, r in self.results.items() if not r.ok]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> Runs:
    """The 2-process runs of the selected tests of this module, in two torchrun launches."""
    selected = [item for item in request.session.items if item.module is request.module]
    names = {item.originalname for item in selected}
    cases = [item.callspec.params["case"] for item in selected
             if item.originalname == "test_two_process_training_and_bit_identical_resume"]
    root = tmp_path_factory.mktemp("example_runs")
    first: list[Job] = []
    then: list[tuple[str, Job]] = []  # (the first run it starts from, job)
    for case in cases:
        args = [*RESUME_COMMON, *CASES[case]]
        first.append(_train(f"{case}/full", root / case / "full", args))
        then.append((f"{case}/full", _train(f"{case}/resumed", root / case / "resumed", ["--resume", *args])))
    if "test_checkpoint_saved_at_pp2_loads_at_dp2_and_pp1" in names:
        src = root / "reshard" / "pp2"
        first.append(_train("reshard/pp2", src, ["--pp", "2", "--save-interval", "2", *RESHARD_COMMON]))
        then.append(("reshard/pp2", Job("reshard/dp2", [TOOL, "reshard", str(src), "2", str(root / "reshard" / "dp2"),
                                                        "--", *RESHARD_COMMON])))
        then.append(("reshard/pp2", _train("reshard/resumed_dp2", root / "reshard" / "resumed_dp2",
                                           ["--resume", "--pp", "1", *RESHARD_COMMON])))  # DP=2 (the run had PP=2)
    if "test_fifty_step_run_raises_reward_and_writes_dump" in names:
        first.append(_train("fifty/run", root / "fifty" / "run", FIFTY_ARGS))
    if "test_steps_per_rollout_and_ppo_epochs_keep_pi_old_fixed" in names:
        first.append(_train("spr/run", root / "spr" / "run", SPR_ARGS))
    env = {"PYTHONPATH": ROOT}
    results = torchrun_batch(first, root / "batch_first", env=env, what="example runs") if first else {}
    then = [(src, job) for src, job in then if results[src].ok]
    for src, job in then:
        if job.name.endswith("resumed") or job.name.endswith("resumed_dp2"):
            _resume_from(root / src, root / job.name, 2)
    if then:
        results.update(torchrun_batch([job for _, job in then], root / "batch_then", env=env,
                                      what="example runs resumed"))
    return Runs(root, results)


#: the module fixture's two launches run every selected run: the first test using it waits for all of them
BATCH_TIMEOUT_S = 2400


@pytest.mark.timeout(BATCH_TIMEOUT_S)
@pytest.mark.parametrize("case", list(CASES))
def test_two_process_training_and_bit_identical_resume(case, runs):
    """4 steps saving at step 2, and a run resumed from that checkpoint (a fresh process group)."""
    full, resumed = runs.dir(f"{case}/full"), runs.dir(f"{case}/resumed")

    rows = _rows(full)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows)
    assert all(r["update_skipped"] == 0 for r in rows)
    expected_alg = int(case[3])
    with open(full / "args.json", encoding="utf-8") as f:
        assert json.load(f)["algorithm"] == expected_alg
    at2, at4, again = _ckpts((full, 2), (full, 4), (resumed, 4))
    model_keys = [k for k in at4 if not k.startswith("optimizer")]
    assert any(k.startswith("optimizer.state.exp_avg_sq.") for k in at4)
    if "moe" in case:  # no linear biases; the router and the 4 experts per layer are checkpointed
        assert len(model_keys) >= 13 and at4["decoder.layers.mlp.router.weight"].shape == (2, 4, 64)
        assert at4["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 256, 64)
    else:
        assert len(model_keys) >= 16
    moved = [k for k in model_keys if not torch.equal(at4[k], at2[k])]
    assert len(moved) >= 0.9 * len(model_keys), "parameters did not train"
    # resuming from step 2 reproduces step 4 bit for bit: every global model and optimizer tensor
    assert at4.keys() == again.keys()
    diff = [k for k in at4 if not torch.equal(at4[k], again[k])]
    assert not diff, f"resumed run differs in {diff[:5]}"
    strip = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows[2:]]
    assert [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _rows(resumed)] == strip


@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_checkpoint_saved_at_pp2_loads_at_dp2_and_pp1(runs, tmp_path):
    """megatron dist checkpoints are layout-independent: a checkpoint written at PP=2 is loaded into the
    model and optimizer built at DP=2 and at PP=1 and saved again, and every global tensor (weights, Adam
    moments) equals the original bit for bit; a training run resumed at DP=2 from the PP=2 checkpoint
    continues the PP=2 run (same rollout, same loss up to float32 reduction order)."""
    src, dp2 = runs.dir("reshard/pp2"), runs.dir("reshard/dp2")  # saved at PP=2; loaded and saved at DP=2
    _check(
        subprocess.run(
            [sys.executable, TOOL, "reshard", str(src), "2", str(tmp_path / "pp1"), "--", *RESHARD_COMMON],
            cwd=ROOT,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=240,
        )
    )
    original, *layouts = _ckpts((src, 2), (dp2, 2), (tmp_path / "pp1", 2))
    assert any(k.startswith("optimizer.state.exp_avg.") for k in original)
    for layout, again in zip(("dp2", "pp1"), layouts, strict=True):
        assert again.keys() == original.keys(), layout
        diff = [k for k in original if not torch.equal(original[k], again[k])]
        assert not diff, f"{layout}: round trip changed {diff[:5]}"

    resumed = runs.dir("reshard/resumed_dp2")  # resumed at DP=2 from the PP=2 checkpoint
    a, b = _rows(src)[2], _rows(resumed)[0]
    assert b["step"] == 2
    # the rollout comes from the restored lag history: the same tokens, rewards and lengths
    assert (a["reward"], a["response_len"]) == (b["reward"], b["response_len"])
    # pi_old comes from the resharded model: equal up to float32 summation order (PP vs DP reductions)
    for key in ("loss", "grad_norm", "tis/k3_kl"):
        assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key


@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_fifty_step_run_raises_reward_and_writes_dump(runs, tmp_path):
    """Two processes (data parallel 2), algorithm 2 with the default bf16 engine: the reward of a
    50-step run beats its initial reward clearly (random policy: 1/16 per digit)."""
    run = runs.dir("fifty/run")
    rewards = [r["reward"] for r in _rows(run)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.15 and last > first + 0.15, (first, last)
    from slime_tis.tools.dump import read_logprob_dump

    dump = read_logprob_dump(str(run / "logprobs.jsonl"))
    assert sorted(set(dump.step.tolist())) == [0, 25, 49] and dump.n_seq == 3 * 256
    assert torch.isfinite(dump.train_log_probs).all() and (dump.train_log_probs <= 0).all()
    # bf16 decode vs fp32 training: close, not identical
    gap = (dump.train_log_probs - dump.rollout_log_probs).abs()
    assert 0 < gap.max() < 0.5
    # the dump is `slime-tis diagnose` input; the curves are `python -m examples.plot` input
    from examples.plot import main as plot_main
    from slime_tis.cli import main as cli

    assert cli(["diagnose", str(run / "logprobs.jsonl")]) == 0
    assert plot_main([str(run), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.timeout(300)
def test_multinode_launch_two_torchrun_agents_c10d(tmp_path):
    """Two torchrun agents as two "nodes" (one process each) meeting at a c10d rendezvous on
    127.0.0.1, pipeline parallel across the nodes, train 3 steps."""
    port, run = free_port(), tmp_path / "mn"
    procs = []
    for node_rank in (0, 1):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "slime-tis-example-test",
            "-m",
            "examples.rl.train",
            "--no-progress",
            "--run-dir",
            str(run),
            "--steps",
            "3",
            "--pp",
            "2",
            "--use-tis",
            "--prompts-per-step",
            "8",
            "--group-size",
            "4",
            "--dump-interval",
            "0",
        ]
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    try:
        outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, f"{out[-2000:]}\n{err[-5000:]}"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    with open(run / "args.json", encoding="utf-8") as f:
        assert json.load(f)["world_size"] == 2


#: metrics that are counts or functions of the sampled tokens only (equal when the same tokens are sampled)
DISCRETE_KEYS = ("step", "reward", "reward_std", "response_len", "update_skipped")


@pytest.mark.timeout(300)
def test_sglang_url_http_path_matches_embedded_engine(tmp_path):
    """--sglang-url against the embedded engine served over HTTP: weights travel through
    /update_weights_from_disk, rollouts through /generate, and the run matches the in-process one.

    Both engines decode in float32 (server ``--dtype float32``, trainer ``--engine-dtype float32``): two
    processes need not run bit-identical kernels (data alignment and kernel choice differ, e.g. bf16
    log-probs differed in the 5th digit on an AMD EPYC), and float32 makes the comparison both robust and
    stricter: a transport error of one weight ulp in bf16 would hide in bf16 rounding, here it shows at 1e-6.
    Tolerances: the sampled tokens, rewards and lengths are equal exactly (a token flips only if a uniform
    draw lands within ~1e-6 of a CDF boundary); every other metric within rtol 1e-4 / atol 1e-6 (float32
    log-probs differ by ~1e-6 between kernels; 3 Adam steps at lr 3e-3 amplify that to <= 1e-5 relative).
    """
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "examples.rl.http_server", "--port", str(port), "--dtype", "float32",
         "--weights-root", str(tmp_path / "http")],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        args = ["--steps", "3", "--use-tis", "--prompts-per-step", "8", "--group-size", "4", "--dump-interval", "0"]
        _python_train(["--run-dir", str(tmp_path / "http"), "--sglang-url", f"http://127.0.0.1:{port}", *args])
        _python_train(["--run-dir", str(tmp_path / "embedded"), "--engine-dtype", "float32", *args])
        from examples.rl.http_client import SGLangClient as Client

        info = Client(f"http://127.0.0.1:{port}")._call("GET", "/get_model_info")
        assert info["weight_version"] == 4  # initial push + one per step
        assert info["model_path"] == str(tmp_path / "http" / "engine_weights")
    finally:
        server.terminate()
        try:
            server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
    http, emb = _rows(tmp_path / "http"), _rows(tmp_path / "embedded")
    assert len(http) == len(emb) == 3
    for h, e in zip(http, emb):
        assert h.keys() == e.keys()
        assert {k: h[k] for k in DISCRETE_KEYS} == {k: e[k] for k in DISCRETE_KEYS}
        cont = [k for k in h if k not in DISCRETE_KEYS and k not in TIMING_KEYS]
        got = torch.tensor([h[k] for k in cont], dtype=torch.float64)
        ref = torch.tensor([e[k] for k in cont], dtype=torch.float64)
        torch.testing.assert_close(
            got, ref, rtol=1e-4, atol=1e-6, equal_nan=True, msg=lambda m, cont=cont: f"{cont}: {m}"
        )
    assert os.path.isfile(tmp_path / "http" / "engine_weights" / "config.json")


@pytest.mark.timeout(BATCH_TIMEOUT_S)
def test_steps_per_rollout_and_ppo_epochs_keep_pi_old_fixed(runs):
    """--steps-per-rollout 2 --ppo-epochs 2 (4 optimizer steps per rollout, pi_old computed once per rollout):
    the rollout's last optimizer step sees pi_theta != pi_old (policy/ppo_kl != 0); with a per-step recompute
    it would be 0 up to rounding. PP=2, algorithm 0."""
    run = runs.dir("spr/run")
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["update_skipped"] == 0 for r in rows)
    assert all(abs(r["policy/ppo_kl"]) > 1e-5 for r in rows), [r["policy/ppo_kl"] for r in rows]
    with open(run / "args.json", encoding="utf-8") as f:
        saved = json.load(f)
    assert saved["steps_per_rollout"] == 2 and saved["ppo_epochs"] == 2
