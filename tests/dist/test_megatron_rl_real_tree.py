"""The documented launch over Megatron-LM's real tree: ``torchrun --nproc-per-node 2 -m slime_tis.megatron_rl
train_rl.py <Megatron-LM flags> <plugin flags>`` with ``train_rl.py`` and its ``megatron`` package (core
included) from NVIDIA/Megatron-LM commit d98e8a64dd (``tests/_megatron_lm_tree.py`` finds it,
extracted here and put first on ``PYTHONPATH``), on CPU with gloo: a tiny GPT (2 layers, hidden 32, vocabulary 64,
sequences of 16), one rollout collection of 4 prompts x 4 samples trained in two optimizer steps of 8 rows, SGD at
learning rate 1 so that the second step's ratios leave the clip range, in two launches: DP=2 with micro-batches of
one row (4 per rank and step; Megatron-LM's THD ``packed_seq_params``), and CP=2 (DP=1) with micro-batches of two
rows (4 per step; each row split over the two ranks in megatron-core's load-balanced layout) and
``--calculate-per-token-loss``.

Megatron-LM runs as shipped (``parse_and_validate_args`` -> ``pretrain`` -> ``train`` -> ``get_grpo_data_iterator``
-> ``prepare_data_for_update`` -> ``train_step``, Megatron DDP, its SGD) except for the stand-ins of
``tests/dist/_mlm_rl_cpu.py`` (installed at start-up by ``_mlm_boot/sitecustomize.py``), which stub only:

* the inference engine: ``rl_utils.get_environment_rollouts`` returns rollouts made in-process, whose inference
  log-probs are the current weights' float64 log-probs at the sampling temperature plus a seeded 0.3-nat Gaussian
  perturbation;
* CUDA calls: the project's CPU layer (``examples/rl/cpu_compat.py``), a device count of 1 and a no-op
  ``set_device``, ``initialize_megatron(allow_no_cuda=True)``, no JIT-fusion warm-up (``torch.compile`` of the
  CUDA fusions) and no build of the C++ dataset helpers;
* TE's packed and context-parallel attention: ``--spec _mlm_rl_cpu CPU_LAYER_SPEC``, the local GPT layer with a
  core attention that honours the ``packed_seq_params`` Megatron-LM passes (causal within each ``cu_seqlens``
  segment) and, under CP, gathers K and V over the CP group (``tests/_cpu/cpu_cp_attention.py``);
* imports only: placeholders for ``wandb``, ``openai``, ``fastapi``, ``uvicorn`` where not installed,
  ``typing.override`` on Python 3.11, ``bos_id = None`` on the synthetic ``NullTokenizer``.

Checked, on both ranks and both steps of each launch, against a float64 computation on whole rows (no context
parallelism: the model run in float64 on the step's global rows, the plugin's algorithm 2 written out): the loss
Megatron-LM's ``train_step`` logs and every gradient (``main_grad`` after Megatron DDP's reduction over DP x CP);
so CP=2 equals CP=1 within the float32 tolerance. The plugin flags are ``--use-tis --eps-clip 0.2 --tis-kl-coef 0``
with Megatron-LM's ``--rl-importance-sampling-truncation-coef 2``: the explicit ``--eps-clip`` must win over
``--grpo-clamp-eps-lower``'s default 0.01 and ``--tis-kl-coef 0`` over ``--grpo-kl-beta``'s default 0.001 (no
pi_ref pass, no KL metric). Skipped, saying so, where the tree is not found.
"""

from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import pytest
from _launch import torchrun
from _megatron_lm_tree import MISSING, TARBALL

HERE = Path(__file__).resolve().parent

pytestmark = [pytest.mark.dist, pytest.mark.slow,
              pytest.mark.skipif(not TARBALL.is_file(), reason=MISSING)]

#: Megatron-LM's flags: a tiny GPT on CPU (local layers, no fusions, learned positions), GRPO with one collection
#: of 16 rollouts trained in two steps of 8
MEGATRON_LM = ["--distributed-backend", "gloo", "--transformer-impl", "local", "--spec", "_mlm_rl_cpu",
               "CPU_LAYER_SPEC", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--max-position-embeddings", "16", "--position-embedding-type",
               "learned_absolute", "--global-batch-size", "8", "--train-iters", "2",
               "--lr", "1.0", "--optimizer", "sgd", "--weight-decay", "0", "--clip-grad", "0", "--tokenizer-type",
               "NullTokenizer", "--vocab-size", "64", "--null-tokenizer-pad-id", "0", "--perform-rl-step",
               "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--grpo-iterations", "1",
               "--eval-iters", "0", "--no-gradient-accumulation-fusion", "--use-cpu-initialization",
               "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1", "--no-persist-layer-norm",
               "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion",
               "--no-bias-dropout-fusion", "--no-rope-fusion", "--rl-default-temperature", "0.8",
               "--rl-importance-sampling-truncation-coef", "2"]
PLUGIN = ["--use-tis", "--eps-clip", "0.2", "--tis-kl-coef", "0"]
EPS = "0.2"  # what the oracle clips at: the --eps-clip typed above (symmetric)
STEPS = 2
#: layout -> (its Megatron-LM flags, DP size): DP=2 with micro-batches of one row (Megatron-LM's THD
#: ``packed_seq_params``), and CP=2 (DP=1) with micro-batches of two rows (megatron-core's load-balanced split) and
#: the per-token loss form (``--calculate-per-token-loss``: the 3-tuple loss)
LAYOUTS = {"dp2": (["--micro-batch-size", "1"], 2),
           "cp2": (["--micro-batch-size", "2", "--context-parallel-size", "2", "--calculate-per-token-loss"], 1)}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron-lm-d98e8a64dd")
    with tarfile.open(TARBALL) as archive:
        archive.extractall(root, filter="data")
    return root


@pytest.fixture(scope="module", params=list(LAYOUTS))
def records(request, tree, tmp_path_factory) -> list[dict]:
    flags, _ = LAYOUTS[request.param]
    out = tmp_path_factory.mktemp(f"records_{request.param}")
    path = os.pathsep.join([str(HERE / "_mlm_boot"), str(tree), os.environ.get("PYTHONPATH", "")])
    torchrun(["-m", "slime_tis.megatron_rl"], [str(tree / "train_rl.py"), *MEGATRON_LM, *flags, *PLUGIN], nproc=2,
             timeout=300, what=f"train_rl.py on Megatron-LM d98e8a64dd ({request.param})",
             env={"PYTHONPATH": path, "SLIME_TIS_MLM_CPU": "1", "SLIME_TIS_MLM_OUT": str(out),
                  "SLIME_TIS_MLM_EPS": EPS, "CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    rows = [json.loads(line) for f in sorted(out.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    print(json.dumps([{k: r[k] for k in ("rank", "step", "oracle_loss", "grad_err", "passes")} for r in rows]))
    return [dict(r, layout=request.param) for r in rows]


def test_the_launch_trains_two_steps_of_one_collection_on_each_rank(records) -> None:
    dp = LAYOUTS[records[0]["layout"]][1]
    assert sorted((r["rank"], r["step"]) for r in records) == [(k, s) for k in range(2) for s in range(STEPS)]
    assert {r["collection"] for r in records} == {1} and {r["dp"] for r in records} == {dp}
    assert all(r["n_params"] > 20 and r["tokens"] > 20 for r in records)


def test_logged_loss_and_every_gradient_equal_the_float64_oracle(records) -> None:
    """Tolerances: float32 forward and backward of a 2-layer model over at most 128 tokens, sums in another
    order than the float64 oracle, and pi_old taken in float32 by the host (float64 in the oracle): 1e-6 of the
    loss, 1e-5 of the largest gradient entry (measured: a few 1e-8 and a few 1e-7)."""
    for r in records:
        assert abs(r["logged"]["lm loss"] - r["oracle_loss"]) <= 1e-6 * max(1.0, abs(r["oracle_loss"])), r
        assert r["grad_err"] < 1e-5, (r["rank"], r["step"], r["grad_err"], r["grad_err_param"])


def test_the_explicit_eps_clip_and_tis_kl_coef_0_are_honoured(records) -> None:
    """``--eps-clip 0.2`` clips the second step's ratios (the oracle above clips at 0.2, not 0.01);
    ``--tis-kl-coef 0``: one log-prob pass per collection (pi_old; no pi_ref) and no KL metric logged."""
    second = [r for r in records if r["step"] == 1]
    assert all(r["logged"]["policy/clipfrac"] > 0.05 for r in second)
    for r in records:
        assert r["passes"] == 1, r["passes"]
        assert "policy/kl" not in r["logged"]
        assert r["logged"]["tis/weight_max"] <= 2.0  # Megatron-LM's truncation coefficient, as the upper bound


def test_the_training_forward_gets_megatron_lms_packed_seq_params_for_unpacked_rows(records) -> None:
    """DP=2: as ``train_rl.forward_step``, every attention call of a training step (4 micro-batches of one row, 2
    layers) has ``packed_seq_params`` (one THD sequence spanning the row), none runs without them. CP=2: the
    rows are split in megatron-core's load-balanced layout (``sbhd``), without THD parameters (4 micro-batches of
    two rows, 2 layers)."""
    for r in records:
        if r["layout"] == "dp2":
            assert r["attention_with_params"] == 4 * 2 and r["attention_without_params"] == 0, r
        else:
            assert r["attention_with_params"] == 0 and r["attention_without_params"] == 4 * 2, r

