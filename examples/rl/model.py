"""The tiny policy: a megatron-core GPT for training and a plain-torch KV-cache decoder for rollouts.

Both read the same weights. The megatron model is configured to be exactly GPT-2 (learned absolute
positions, LayerNorm eps 1e-5, tanh-GELU MLP of width 4h, biases, tied input/output embeddings), so its
weights export to the Hugging Face GPT-2 layout (``transformer.h.{i}.attn.c_attn.weight`` ...). That
layout is the rollout engine's weight format: the embedded :class:`KVCacheGPT` reads it, and a real
SGLang server loads it via ``/update_weights_from_disk`` (see :mod:`examples.rl.weight_sync`).

Mixture of experts (``moe_experts = E > 0``, ``moe_topk = k``): every block's MLP is a megatron-core MoE layer
(``TopKRouter``: ``logits = x @ W_gate^T`` ``[T, E]``, the top-k experts by logit, weights
``softmax(top-k logits)``; ``SequentialMLP`` experts, each a GPT-2 MLP without biases; output
``sum_j w_j * expert_{i_j}(x)``). Its weights export as ``transformer.h.{i}.mlp.gate.weight`` ``[E, h]`` and
``transformer.h.{i}.mlp.experts.{e}.c_fc.weight`` / ``.c_proj.weight`` (Conv1D layout), and the config as
``num_local_experts`` / ``num_experts_per_tok``; the MoE model has no linear biases (the attention biases export
as zeros so the GPT-2 layout is kept). Only the embedded engine reads this MoE variant of the layout.

Tensor shapes: hidden ``h``, heads ``n``, head dim ``d = h / n``, vocab ``V``.
Megatron fused QKV is ``[n * 3d, h]`` grouped per head (``[q_j; k_j; v_j]`` for head j, no GQA);
GPT-2 ``c_attn`` is a Conv1D ``[h, 3h]`` laid out ``[Q | K | V]`` (all heads of Q first).
"""

from __future__ import annotations

import functools
import json
import math
import os
import stat
from dataclasses import dataclass

import torch
import torch.nn.functional as F

GELU_TANH = functools.partial(F.gelu, approximate="tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the tiny GPT (shared by trainer and rollout engine)."""

    vocab_size: int = 16
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    max_seq_len: int = 16
    layernorm_eps: float = 1e-5
    moe_experts: int = 0  # 0 = dense MLP; E > 0 = a mixture of E experts in every block
    moe_topk: int = 0  # experts per token (1 <= k <= E when moe_experts > 0)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.moe_experts < 0 or (self.moe_experts == 0 and self.moe_topk != 0):
            raise ValueError(
                f"moe_experts must be >= 0 (and moe_topk 0 for a dense model), got moe_experts="
                f"{self.moe_experts}, moe_topk={self.moe_topk}"
            )
        if self.moe_experts and not 1 <= self.moe_topk <= self.moe_experts:
            raise ValueError(f"moe_topk must be in [1, moe_experts={self.moe_experts}], got {self.moe_topk}")

    @property
    def is_moe(self) -> bool:
        return self.moe_experts > 0

    def to_hf_config(self, eos_token_id: int) -> dict:
        """A Hugging Face ``config.json`` (GPT2LMHeadModel) describing the same network."""
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "vocab_size": self.vocab_size,
            "n_positions": self.max_seq_len,
            "n_embd": self.hidden_size,
            "n_layer": self.num_layers,
            "n_head": self.num_heads,
            "n_inner": 4 * self.hidden_size,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": self.layernorm_eps,
            "tie_word_embeddings": True,
            "bos_token_id": eos_token_id,
            "eos_token_id": eos_token_id,
            "torch_dtype": "float32",
            "dtype": "float32",
            **({"num_local_experts": self.moe_experts, "num_experts_per_tok": self.moe_topk} if self.is_moe else {}),
        }


# --------------------------------------------------------------------------------------------------
# megatron-core side
# --------------------------------------------------------------------------------------------------
def _moe_config(cfg: ModelConfig) -> dict:
    """TransformerConfig fields of the MoE variant (empty for the dense model, whose config is unchanged).

    Top-k router on the raw logits with softmax over the chosen k (megatron's default ``score_function``),
    no load-balancing loss, no token dropping, ``SequentialMLP`` experts (no grouped GEMM, no
    transformer-engine), the router's replay hook enabled (inactive unless the plugin's hook sets a replay:
    ``slime_tis.megatron.routing_replay``). No linear biases: megatron-core 0.16's expert MLP adds its bias in
    place on a custom-function view, which autograd refuses on CPU.
    """
    if not cfg.is_moe:
        return {}
    import megatron.core.transformer.moe.moe_utils as moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16 without transformer-engine: unbound name
        moe_utils.te_general_gemm = None
    return {
        "num_moe_experts": cfg.moe_experts,
        "moe_router_topk": cfg.moe_topk,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_enable_routing_replay": True,
        "add_bias_linear": False,
    }


def build_megatron_gpt(
    cfg: ModelConfig, *, tp: int = 1, pp: int = 1, use_cpu_initialization: bool = True
) -> torch.nn.Module:
    """Build this rank's pipeline stage of the GPT (``parallel_state`` must be initialised).

    The parallel sizes are also written into the ``TransformerConfig``: megatron-core reads the pipeline
    size from there, and without it every stage silently builds all the layers.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg.num_layers % pp:
        raise ValueError(f"num_layers ({cfg.num_layers}) must be divisible by the pipeline size ({pp})")
    moe = _moe_config(cfg)
    tcfg = TransformerConfig(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        ffn_hidden_size=4 * cfg.hidden_size,
        activation_func=GELU_TANH,
        layernorm_epsilon=cfg.layernorm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=use_cpu_initialization,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        **moe,
    )
    spec = (
        get_gpt_layer_local_spec(num_experts=cfg.moe_experts, moe_grouped_gemm=False)
        if moe
        else (get_gpt_layer_local_spec())
    )
    return GPTModel(
        config=tcfg,
        transformer_layer_spec=spec,
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_seq_len,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def export_local_gpt2_weights(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """This pipeline stage's weights in GPT-2 naming (fp32 CPU copies, global layer indices)."""
    gpt = _unwrap(model)
    n, d, h = cfg.num_heads, cfg.hidden_size // cfg.num_heads, cfg.hidden_size
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.detach().to(device="cpu", dtype=torch.float32).clone()

    if getattr(gpt, "pre_process", False):
        put("transformer.wte.weight", gpt.embedding.word_embeddings.weight)
        put("transformer.wpe.weight", gpt.embedding.position_embeddings.weight)
    for layer in gpt.decoder.layers:
        i = layer.layer_number - 1  # megatron layer numbers are global and 1-based
        p = f"transformer.h.{i}."
        put(p + "ln_1.weight", layer.input_layernorm.weight)
        put(p + "ln_1.bias", layer.input_layernorm.bias)
        attn = layer.self_attention
        qkv_w = attn.linear_qkv.weight.view(n, 3, d, h)  # [head, q/k/v, d, h]
        put(p + "attn.c_attn.weight", qkv_w.permute(1, 0, 2, 3).reshape(3 * h, h).t())
        put(p + "attn.c_proj.weight", attn.linear_proj.weight.t())
        if attn.linear_qkv.bias is not None:
            qkv_b = attn.linear_qkv.bias.view(n, 3, d)
            put(p + "attn.c_attn.bias", qkv_b.permute(1, 0, 2).reshape(3 * h))
            put(p + "attn.c_proj.bias", attn.linear_proj.bias)
        else:  # the MoE model has no linear biases: zeros keep the GPT-2 layout
            put(p + "attn.c_attn.bias", torch.zeros(3 * h))
            put(p + "attn.c_proj.bias", torch.zeros(h))
        put(p + "ln_2.weight", layer.pre_mlp_layernorm.weight)
        put(p + "ln_2.bias", layer.pre_mlp_layernorm.bias)
        if cfg.is_moe:
            put(p + "mlp.gate.weight", layer.mlp.router.weight)  # [E, h]
            for e, expert in enumerate(layer.mlp.experts.local_experts):
                put(p + f"mlp.experts.{e}.c_fc.weight", expert.linear_fc1.weight.t())
                put(p + f"mlp.experts.{e}.c_proj.weight", expert.linear_fc2.weight.t())
            continue
        put(p + "mlp.c_fc.weight", layer.mlp.linear_fc1.weight.t())
        put(p + "mlp.c_fc.bias", layer.mlp.linear_fc1.bias)
        put(p + "mlp.c_proj.weight", layer.mlp.linear_fc2.weight.t())
        put(p + "mlp.c_proj.bias", layer.mlp.linear_fc2.bias)
    if getattr(gpt, "post_process", False):
        put("transformer.ln_f.weight", gpt.decoder.final_layernorm.weight)
        put("transformer.ln_f.bias", gpt.decoder.final_layernorm.bias)
    return out


def gather_gpt2_weights(model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Full GPT-2-layout weights, assembled from all pipeline stages (collective over the PP group).

    Tensor parallelism is not supported by this exporter (the example runs TP=1).
    """
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() != 1:
        raise ValueError(
            f"tensor_model_parallel_size={ps.get_tensor_model_parallel_world_size()} is not supported by "
            "the example's weight export; use --pp or --dp"
        )
    local = export_local_gpt2_weights(model, cfg)
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return local
    parts: list[dict[str, torch.Tensor] | None] = [None] * ps.get_pipeline_model_parallel_world_size()
    torch.distributed.all_gather_object(parts, local, group=ps.get_pipeline_model_parallel_group())
    full: dict[str, torch.Tensor] = {}
    for part in parts:
        full.update(part or {})
    return full


# --------------------------------------------------------------------------------------------------
# Hugging Face GPT-2 checkpoint on disk (what /update_weights_from_disk loads)
# --------------------------------------------------------------------------------------------------
WEIGHTS_FILE = "model.safetensors"


def save_hf_checkpoint(path: str, weights: dict[str, torch.Tensor], cfg: ModelConfig, eos_token_id: int) -> None:
    """Write a Hugging Face GPT-2 checkpoint: ``config.json`` + ``model.safetensors`` (float32, GPT-2 names;
    ``lm_head`` is tied to ``wte`` and not stored). Loadable by ``GPT2LMHeadModel.from_pretrained`` and by
    SGLang's ``/update_weights_from_disk``. The weights file is written to a temporary name and renamed."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_config(eos_token_id), f, indent=1)
    tensors = {k: v.detach().to(device="cpu", dtype=torch.float32).contiguous() for k, v in weights.items()}
    tensors.pop("lm_head.weight", None)  # tied (config.tie_word_embeddings); safetensors refuses shared storage
    tmp = os.path.join(path, WEIGHTS_FILE + ".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, WEIGHTS_FILE))


#: the files :func:`load_hf_checkpoint` reads from a checkpoint directory
CHECKPOINT_FILES = ("config.json", WEIGHTS_FILE)


def _read_no_link(path: str) -> bytes:
    """The bytes of the regular file ``path``, refusing a symlink at the last component (``O_NOFOLLOW``)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise OSError(e.errno, f"{path}: {e.strerror}" + (" (a symlink)" if os.path.islink(path) else "")) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        return f.read()


def load_hf_checkpoint(
    path: str, *, files: dict[str, str] | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint written by :func:`save_hf_checkpoint` (``model.safetensors``).

    ``files``: the path to read for each name of :data:`CHECKPOINT_FILES` (resolved and checked by the
    caller); each is then opened without following a symlink."""
    if files is not None:
        from safetensors.torch import load as load_bytes

        hf = json.loads(_read_no_link(files["config.json"]))
        cfg = _config_of(hf)
        return cfg, load_bytes(_read_no_link(files[WEIGHTS_FILE]))
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    weights = load_file(os.path.join(path, WEIGHTS_FILE), device="cpu")
    return _config_of(hf), weights


def _config_of(hf: dict) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face GPT-2 ``config.json``."""
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        num_layers=hf["n_layer"],
        hidden_size=hf["n_embd"],
        num_heads=hf["n_head"],
        max_seq_len=hf["n_positions"],
        layernorm_eps=hf["layer_norm_epsilon"],
        moe_experts=hf.get("num_local_experts", 0),
        moe_topk=hf.get("num_experts_per_tok", 0),
    )


# --------------------------------------------------------------------------------------------------
# inference side: plain-torch GPT-2 with a KV cache
# --------------------------------------------------------------------------------------------------
class KVCacheGPT:
    """GPT-2 forward with an incremental KV cache, in an arbitrary dtype (bfloat16 by default).

    This is deliberately a different numerical path from training (megatron-core, float32, full
    sequence): weights and activations are rounded to ``dtype``, attention runs one query token at a
    time against the cache, and only the final logits are upcast to float32 (as inference engines do).

    ``quant`` (``"none"`` or a scheme of :mod:`examples.rl.quant`): the four linear weights of every block
    are stored as int8 / fp8 codes + float32 scales and dequantized on the fly (``W_hat = q * s`` rounded
    to ``dtype``) in every forward. ``lm_head_fp32``: the output projection reads the float32 weight and
    the hidden state upcast to float32, ``logits = float32(h) @ W_lm^T`` in float32 (the inference-side
    LM-head fix; everything before it stays in ``dtype``).

    MoE blocks route as the training router does, but in ``dtype``: ``logits = m @ W_gate^T`` (``[B, L, E]`` in
    ``dtype``), the top-k experts by those logits, weights ``softmax(float32(top-k logits))`` rounded to
    ``dtype``, output ``sum_j w_j * expert_{i_j}(m)``. Rounded logits reorder near-ties, so some tokens go to
    other experts than in training. ``routes`` (a list) receives every block's chosen experts ``[B, L, k]``.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        weights: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        quant: str = "none",
        lm_head_fp32: bool = False,
    ) -> None:
        from examples.rl.quant import ENGINE_QUANT_CHOICES, is_quantized_linear, quantize

        missing = [k for k in _expected_keys(cfg) if k not in weights]
        if missing:
            raise ValueError(f"weights are missing {len(missing)} GPT-2 keys, e.g. {missing[:3]}")
        if quant not in ENGINE_QUANT_CHOICES:
            raise ValueError(f"quant must be one of {ENGINE_QUANT_CHOICES}, got {quant!r}")
        self.cfg, self.dtype, self.device, self.quant = cfg, dtype, torch.device(device), quant
        lm_head = weights.get("lm_head.weight", weights["transformer.wte.weight"])
        self.lm_head32 = lm_head.to(device=self.device, dtype=torch.float32) if lm_head_fp32 else None
        self.q = {}
        if quant != "none":
            self.q = {k: quantize(v.to(self.device), quant) for k, v in weights.items() if is_quantized_linear(k)}
        self.w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items() if k not in self.q}
        self.w.setdefault("lm_head.weight", self.w["transformer.wte.weight"])

    def weight(self, name: str) -> torch.Tensor:
        """The weight the engine multiplies with: ``self.w[name]``, or the on-the-fly dequantized
        ``codes * scale`` in ``dtype`` for a quantized linear layer."""
        q = self.q.get(name)
        return self.w[name] if q is None else q.dequantize(self.dtype)

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.w[name + ".weight"], self.w[name + ".bias"], self.cfg.layernorm_eps)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None,
        routes: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """Run ``tokens [B, L]`` at positions ``start_pos..start_pos+L-1`` given the cache of the
        previous ``start_pos`` positions. Returns float32 logits ``[B, L, V]`` and the extended cache
        (per layer ``(k, v)`` each ``[B, n, start_pos + L, d]``); a MoE model appends each block's experts
        ``[B, L, k]`` to ``routes`` when given."""
        x, new_cache = self.hidden(tokens, start_pos, cache, routes)
        return self.lm_head(x), new_cache

    @torch.no_grad()
    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[B, L, V]`` from the final hidden state ``x [B, L, h]`` (in ``dtype``):
        ``float32(x @ W_lm^T)`` in ``dtype``, or ``float32(x) @ float32(W_lm)^T`` with ``lm_head_fp32``."""
        if self.lm_head32 is not None:
            return x.float() @ self.lm_head32.t()
        return (x @ self.w["lm_head.weight"].t()).float()

    @torch.no_grad()
    def hidden(
        self,
        tokens: torch.Tensor,
        start_pos: int,
        cache: list[tuple[torch.Tensor, torch.Tensor]] | None,
        routes: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, list]:
        """The transformer up to and including the final LayerNorm: ``[B, L, h]`` in ``dtype``, and the cache."""
        cfg, w = self.cfg, self.w
        b, length = tokens.shape
        n, d = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        if start_pos + length > cfg.max_seq_len:
            raise ValueError(f"sequence length {start_pos + length} exceeds max_seq_len {cfg.max_seq_len}")
        pos = torch.arange(start_pos, start_pos + length, device=self.device)
        x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][pos]
        new_cache = []
        for i in range(cfg.num_layers):
            p = f"transformer.h.{i}."
            a = self._ln(x, p + "ln_1")
            qkv = a @ self.weight(p + "attn.c_attn.weight") + w[p + "attn.c_attn.bias"]
            q, k, v = (t.view(b, length, n, d).transpose(1, 2) for t in qkv.split(cfg.hidden_size, dim=-1))
            if cache is not None:
                k = torch.cat([cache[i][0], k], dim=2)
                v = torch.cat([cache[i][1], v], dim=2)
            new_cache.append((k, v))
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # [B, n, L, start_pos + L]
            qpos = pos.view(-1, 1)
            kpos = torch.arange(start_pos + length, device=self.device).view(1, -1)
            scores = scores.masked_fill(kpos > qpos, float("-inf"))
            att = torch.softmax(scores.float(), dim=-1).to(self.dtype) @ v
            att = att.transpose(1, 2).reshape(b, length, cfg.hidden_size)
            x = x + att @ self.weight(p + "attn.c_proj.weight") + w[p + "attn.c_proj.bias"]
            m = self._ln(x, p + "ln_2")
            if cfg.is_moe:
                x = x + self._moe(m, p, routes)
                continue
            m = GELU_TANH(m @ self.weight(p + "mlp.c_fc.weight") + w[p + "mlp.c_fc.bias"])
            x = x + m @ self.weight(p + "mlp.c_proj.weight") + w[p + "mlp.c_proj.bias"]
        return self._ln(x, "transformer.ln_f"), new_cache

    def _moe(self, m: torch.Tensor, p: str, routes: list[torch.Tensor] | None) -> torch.Tensor:
        """The MoE block ``[B, L, h] -> [B, L, h]`` in ``dtype`` (class docstring). Every expert runs on every
        token (tiny model: cheaper than dispatching); the top-k are gathered."""
        logits = m @ self.w[p + "mlp.gate.weight"].t()  # [B, L, E] in dtype
        top_logits, top_idx = logits.topk(self.cfg.moe_topk, dim=-1)  # [B, L, k]
        weights = torch.softmax(top_logits.float(), dim=-1).to(self.dtype)
        experts = [p + f"mlp.experts.{e}." for e in range(self.cfg.moe_experts)]
        outs = torch.stack(
            [GELU_TANH(m @ self.weight(q + "c_fc.weight")) @ self.weight(q + "c_proj.weight") for q in experts], dim=-2
        )  # [B, L, E, h]
        chosen = outs.gather(-2, top_idx.unsqueeze(-1).expand(*top_idx.shape, outs.shape[-1]))  # [B, L, k, h]
        if routes is not None:
            routes.append(top_idx)
        return (weights.unsqueeze(-1) * chosen).sum(dim=-2)


def _expected_keys(cfg: ModelConfig) -> list[str]:
    keys = [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.ln_f.weight",
        "transformer.ln_f.bias",
    ]
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for name in ("ln_1", "ln_2", "attn.c_attn", "attn.c_proj") + (() if cfg.is_moe else ("mlp.c_fc", "mlp.c_proj")):
            keys += [p + name + ".weight", p + name + ".bias"]
        if cfg.is_moe:
            keys.append(p + "mlp.gate.weight")
            for e in range(cfg.moe_experts):
                keys += [p + f"mlp.experts.{e}.c_fc.weight", p + f"mlp.experts.{e}.c_proj.weight"]
    return keys
