"""CPU stand-ins for Megatron-LM's real ``train_rl.py`` (commit d98e8a64dd) under the documented launch, and the
float64 oracle the test compares it with (``tests/dist/test_megatron_rl_real_tree.py``).

Imported at interpreter start-up in each torchrun worker of that launch (``_mlm_boot/sitecustomize.py``), before
``python -m slime_tis.megatron_rl train_rl.py ...`` runs. Everything of Megatron-LM runs as shipped except:

* **CUDA calls**: the project's CPU layer (``examples/rl/cpu_compat.py``, through ``tests/_cpu/cpu_shim.py``),
  plus ``torch.cuda.device_count() -> 1`` and a no-op ``torch.cuda.set_device`` (Megatron-LM initialises its
  model-parallel groups and its RNG tracker only where it counts a device), ``initialize_megatron`` with its own
  ``allow_no_cuda=True``, no warm-up of the JIT fusion kernels (``set_jit_fusion_options``: ``torch.compile``
  of the CUDA fusions, which on CPU would have inductor compile C++; the launch turns the fusions off with
  Megatron-LM's ``--no-*-fusion`` flags), no build of the C++ dataset helpers (the RL loop reads no indexed
  dataset; the project compiles nothing) and a device-architecture answer (``get_device_arch_version``, read by
  ``validate_args`` for TP / CP > 1);
* **TE's packed and context-parallel attention**: :data:`CPU_LAYER_SPEC` (``--spec _mlm_rl_cpu CPU_LAYER_SPEC``),
  Megatron-LM's local GPT layer with a core attention that honours the ``packed_seq_params`` (THD) the forward
  passes: causal attention within each ``cu_seqlens_q`` segment (Megatron-LM's local ``DotProductAttention``
  refuses them); under context parallelism the project's CPU CP attention (``tests/_cpu/cpu_cp_attention.py``);
* **the inference engine**: ``rl_utils.get_environment_rollouts`` returns rollouts made here
  (:func:`make_rollouts`): random prompts and completions, each completion's inference log-probs = the float64
  log-probs of the current weights at ``--rl-default-temperature`` plus a seeded Gaussian perturbation
  (:data:`PERTURBATION` nats), group rewards drawn at random;
* **imports only**: ``wandb`` (a type annotation of ``rl_utils``), ``openai``, ``fastapi`` and ``uvicorn`` (the
  inference server and client, not run) get placeholder modules where they are not installed; Python 3.11 gets
  ``typing.override`` from ``typing_extensions`` (the tree's two uses are decorators); the ``NullTokenizer`` (the
  synthetic tokenizer, ``--tokenizer-type NullTokenizer``) gets ``bos_id = None`` (no BOS token), which
  ``prepare_trajectories`` reads.

Recorded (``$SLIME_TIS_MLM_OUT/rank{r}.jsonl``, one line per optimizer step): what Megatron-LM's ``train_step``
logs (``lm loss``, every ``tis/*`` key), the float64 oracle's loss of the step, the largest gradient error of
``main_grad`` (after Megatron DDP's reduction) against the oracle's gradient, and the forward passes Megatron-LM's
``compute_logprobs_batch`` ran so far.

The oracle (:func:`oracle_step`): the step's rows as Megatron-LM splits them (the collection group-major, DP rank
``r`` takes the ``r``-th contiguous share, each step the next ``global_batch / DP`` rows of it), the model run in
float64 on whole rows (``torch.func.functional_call`` with float64 copies of the weights; no context-parallel split)
at temperature ``T``, and the plugin's
algorithm 2 written out: token weight ``w = min(exp(lp_old - lp_inf), C)``, ratio ``r = exp(lp - lp_old)``, loss
``sum(mask * -min(r A, clip(r, 1 - eps, 1 + eps_high) A) w) / sum(mask)`` over the step's global batch, with
``lp_old`` the float64 log-probs of the weights the collection was made with.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import json
import os
import sys
import types
import typing

import torch
import typing_extensions

if not hasattr(typing, "override"):  # Python 3.11 (the tree targets 3.12)
    typing.override = typing_extensions.override


class _Placeholder(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _Placeholder(f"{self.__name__}.{name}")
        child.__path__ = []
        sys.modules[child.__name__] = child
        setattr(self, name, child)
        return child

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and not kwargs and callable(args[0]) else self

    def __mro_entries__(self, bases):
        return (object,)


class _PlaceholderFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Placeholder(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        return None


#: import-only packages of the RL modules (see the module docstring)
IMPORT_ONLY = ("wandb", "openai", "fastapi", "uvicorn")
STUBBED = frozenset(r for r in IMPORT_ONLY if importlib.util.find_spec(r) is None)
sys.meta_path.append(_PlaceholderFinder(STUBBED))

from _cpu import cpu_shim  # noqa: E402

cpu_shim.enable_cuda_to_cpu_mode()
torch.cuda.device_count = lambda: 1
torch.cuda.set_device = lambda *a, **k: None

import megatron.core.datasets.utils as _dataset_utils  # noqa: E402
import megatron.training.arguments as _arguments  # noqa: E402
import megatron.training.training as _training  # noqa: E402
from _cpu.cpu_cp_attention import CPUContextParallelAttention  # noqa: E402
from megatron.core import parallel_state as ps  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer  # noqa: E402
from megatron.core.transformer.module import MegatronModule  # noqa: E402
from megatron.rl import rl_utils  # noqa: E402
from megatron.rl.types import RolloutGroup, TokenRollout  # noqa: E402

_dataset_utils.compile_helpers = lambda: None
_arguments.get_device_arch_version = lambda: 9  # a device query (TP / CP > 1 check CUDA_DEVICE_MAX_CONNECTIONS)
NullTokenizer.bos_id = None
_initialize_megatron = _training.initialize_megatron


@functools.wraps(_initialize_megatron)
def _initialize_without_cuda(*args, **kwargs):
    kwargs["allow_no_cuda"] = True
    return _initialize_megatron(*args, **kwargs)


_training.initialize_megatron = _initialize_without_cuda
_training.set_jit_fusion_options = lambda *args, **kwargs: None


# ------------------------------------------------------------------------------------------- packed attention
#: what the launch did so far (rollout collections, log-prob passes, optimizer steps, attention calls with and
#: without ``packed_seq_params``) and the current collection's data for the oracle
STATE: dict = {"collections": 0, "passes": 0, "step": 0, "attention_with_params": 0, "attention_without_params": 0,
               "whole_rows": False}


def segment_ids(packed_seq_params, length: int) -> torch.Tensor:
    """``[length]`` segment of each position from ``cu_seqlens_q`` (positions past its end: one more segment)."""
    seg = torch.full((length,), -1, dtype=torch.int64)
    if packed_seq_params is None:
        return torch.zeros(length, dtype=torch.int64)
    cu = [min(int(c), length) for c in packed_seq_params.cu_seqlens_q]
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seg[a:b] = i
    seg[seg < 0] = len(cu)
    return seg


class CPUPackedAttention(MegatronModule):
    """Megatron-LM's ``core_attention`` slot (``[S, B, heads, d]`` in and ``[S, B, heads * d]`` out; under THD
    ``packed_seq_params`` ``[T, heads, d]`` in and ``[T, 1, heads * d]`` out) on CPU: causal attention within each
    segment of ``packed_seq_params`` (one segment per row without them); under context parallelism the project's
    CPU context-parallel attention (``tests/_cpu/cpu_cp_attention.py``: K and V gathered over the CP group,
    causal in the global positions of megatron-core's load-balanced layout)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.scale = softmax_scale if softmax_scale is not None else config.kv_channels ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        STATE["attention_with_params" if packed_seq_params is not None else "attention_without_params"] += 1
        if ps.get_context_parallel_world_size() > 1 and not STATE["whole_rows"]:  # the CPU CP attention (sbhd)
            assert packed_seq_params is None, "THD context parallelism is not stood in for here"
            return CPUContextParallelAttention.forward(self, query, key, value, attention_mask)
        if query.dim() == 3:  # THD: Megatron-LM squeezed the dummy batch dimension
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        sq = query.shape[0]
        seg = segment_ids(packed_seq_params, sq)
        pos = torch.arange(sq)
        allowed = (seg[:, None] == seg[None, :]) & (pos[:, None] >= pos[None, :])
        if key.shape[2] != query.shape[2]:
            rep = query.shape[2] // key.shape[2]
            key, value = key.repeat_interleave(rep, 2), value.repeat_interleave(rep, 2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return ctx.permute(2, 0, 1, 3).reshape(sq, query.shape[1], -1)


CPU_LAYER_SPEC = get_gpt_layer_local_spec()
CPU_LAYER_SPEC.submodules.self_attention.submodules.core_attention = CPUPackedAttention


# ------------------------------------------------------------------------------------------- oracle model
def _gpt(model):
    from megatron.core.utils import unwrap_model

    return unwrap_model(model[0] if isinstance(model, list) else model)


def log_probs64(gpt, params64: dict, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, S-1]`` float64 log-probs of ``tokens[:, 1:]`` under ``softmax(logits / T)``, the model run with
    ``params64`` on whole rows (each row one causal sequence, no context-parallel split)."""
    from torch.func import functional_call

    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    STATE["whole_rows"] = True  # every rank runs whole rows here, whatever the context-parallel layout
    try:
        logits = functional_call(gpt, params64, (tokens, pos, None))
    finally:
        STATE["whole_rows"] = False
    assert logits.dtype == torch.float64, logits.dtype
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def weights64(gpt) -> dict:
    return {n: p.detach().to(torch.float64).clone() for n, p in gpt.named_parameters()}


# ------------------------------------------------------------------------------------------- the rollouts
#: standard deviation (nats) of the perturbation added to the current policy's log-probs (the inference side)
PERTURBATION = 0.3


def make_rollouts(model, n_prompts: int, group: int):
    """Rollout groups of the current weights (module docstring), identical on every rank; keeps what the oracle
    needs (tokens, masks, inference and pi_old log-probs, rewards) in :data:`STATE`."""
    from megatron.training import get_args

    args = get_args()
    s, vocab, temperature = args.seq_length, args.padded_vocab_size, args.rl_default_temperature
    pad = int(args.null_tokenizer_pad_id)
    g = torch.Generator().manual_seed(1000 + STATE["collections"])
    rows = n_prompts * group
    prompt = torch.randint(2, 5, (rows,), generator=g)
    gen = torch.stack([torch.randint(3, s - int(p) + 1, (1,), generator=g)[0] for p in prompt])
    tokens = torch.randint(1, vocab - 2, (rows, s), generator=g)  # never the pad (0) nor the eod (V-1)
    tokens[tokens == pad] = 1
    col = torch.arange(s)[None]
    length = prompt + gen
    generated = (col >= prompt[:, None]) & (col < length[:, None])
    tokens[col >= length[:, None]] = pad
    gpt = _gpt(model)
    with torch.no_grad():
        lp = log_probs64(gpt, weights64(gpt), tokens, temperature)
    inference = lp + PERTURBATION * torch.randn(lp.shape, generator=g, dtype=torch.float64)
    rewards = torch.rand(n_prompts, group, generator=g, dtype=torch.float64)
    groups = []
    for i in range(n_prompts):
        members = []
        for j in range(group):
            r = i * group + j
            n = int(length[r])
            members.append(TokenRollout(
                trajectory=[tokens[r, :n].tolist()], reward=float(rewards[i, j]),
                generation_mask=[generated[r, :n].tolist()],
                logprobs=[inference[r, generated[r, 1:].nonzero()[:, 0]].tolist()],
                env_id="cpu", problem_id=str(i), generation_cap=int(gen[r])))
        groups.append(RolloutGroup(rollouts=members))
    STATE.update(tokens=tokens, mask=generated[:, 1:].to(torch.float64), lp_old=lp, lp_inf=inference,
                 rewards=rewards, step=0)
    STATE["collections"] += 1
    return groups, {}


def _get_environment_rollouts(model, inference_model, optimizer, n_prompts, samples_per_group):
    return make_rollouts(model, n_prompts, samples_per_group)


rl_utils.get_environment_rollouts = _get_environment_rollouts
_compute_logprobs_batch = rl_utils.compute_logprobs_batch


@functools.wraps(_compute_logprobs_batch)
def _counted_logprobs_batch(*args, **kwargs):
    STATE["passes"] += 1
    return _compute_logprobs_batch(*args, **kwargs)


rl_utils.compute_logprobs_batch = _counted_logprobs_batch


# ------------------------------------------------------------------------------------------- oracle
def advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO advantages per rollout, group-major: ``(r - mean) / (1e-4 + std)`` within each group (population
    standard deviation)."""
    mean = rewards.mean(-1, keepdim=True)
    std = ((rewards - mean) ** 2).mean(-1, keepdim=True).sqrt()
    return ((rewards - mean) / (1e-4 + std)).reshape(-1)


def step_rows(step: int, total: int, dp: int, global_batch: int) -> list[int]:
    """The collection's rows optimizer step ``step`` trains, over all DP ranks (module docstring)."""
    share, per_step = total // dp, global_batch // dp
    return [r * share + step * per_step + i for r in range(dp) for i in range(per_step)]


def oracle_step(gpt, params64: dict, rows: list[int], *, coef: float, eps: float, eps_high: float,
                temperature: float) -> tuple[torch.Tensor, dict]:
    """(loss, gradient per parameter name), float64 (module docstring)."""
    for p in params64.values():
        p.requires_grad_(True)
    idx = torch.tensor(rows)
    tokens, mask = STATE["tokens"][idx], STATE["mask"][idx]
    lp_old, lp_inf = STATE["lp_old"][idx], STATE["lp_inf"][idx]
    adv = advantages(STATE["rewards"])[idx][:, None]
    lp = log_probs64(gpt, params64, tokens, temperature)
    w = torch.clamp(torch.exp(lp_old - lp_inf), max=coef)
    ratio = torch.exp(lp - lp_old)
    surrogate = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps_high) * adv) * w
    loss = (surrogate * mask).sum() / mask.sum()
    names = list(params64)
    grads = torch.autograd.grad(loss, [params64[n] for n in names])
    return loss.detach(), dict(zip(names, grads))


_train_step = _training.train_step


@functools.wraps(_train_step)
def _recorded_train_step(forward_step_func, data_iterator, model, *args, **kwargs):
    from megatron.training import get_args

    a = get_args()
    gpt = _gpt(model)
    params64 = weights64(gpt)
    attention = {k: STATE[k] for k in ("attention_with_params", "attention_without_params")}
    out = _train_step(forward_step_func, data_iterator, model, *args, **kwargs)
    attention = {k: STATE[k] - v for k, v in attention.items()}
    logged = {k: float(v) for k, v in out[0].items()}
    dp = ps.get_data_parallel_world_size()
    rows = step_rows(STATE["step"], STATE["tokens"].shape[0], dp, a.global_batch_size)
    eps_high = float(os.environ.get("SLIME_TIS_MLM_EPS_HIGH", os.environ["SLIME_TIS_MLM_EPS"]))
    loss, grads = oracle_step(gpt, params64, rows, coef=a.rl_importance_sampling_truncation_coef,
                              eps=float(os.environ["SLIME_TIS_MLM_EPS"]), eps_high=eps_high,
                              temperature=a.rl_default_temperature)
    scale = max(float(g.abs().max()) for g in grads.values())
    errs = {n: float((p.main_grad.detach().to(torch.float64) - grads[n]).abs().max()) / scale
            for n, p in gpt.named_parameters()}
    worst = max(errs, key=errs.get)
    record = dict(rank=torch.distributed.get_rank(), step=STATE["step"], collection=STATE["collections"],
                  logged=logged, oracle_loss=float(loss), grad_err=errs[worst], grad_err_param=worst,
                  grad_scale=scale, n_params=len(errs), passes=STATE["passes"], dp=dp,
                  rows=rows, tokens=float(STATE["mask"][torch.tensor(rows)].sum()), **attention)
    with open(os.path.join(os.environ["SLIME_TIS_MLM_OUT"], f"rank{record['rank']}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    STATE["step"] += 1
    return out


_training.train_step = _recorded_train_step
