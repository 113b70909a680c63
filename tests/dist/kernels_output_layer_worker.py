"""torchrun worker (TP=2, gloo, CPU): the fused output layer across a vocabulary split, and its megatron glue.

    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 tests/dist/kernels_output_layer_worker.py --out DIR

Writes ``DIR/rank{r}.json``: measured errors per check (the test asserts the tolerances):

* ``kernel_<backend>``: ``fused_log_probs_and_entropy`` on this rank's weight shard (``tp_group`` = world)
  vs a float64 full-vocabulary oracle: values, the full hidden gradient, this shard of the weight gradient;
  temperature 0.7, masked rows.
* ``gpt_<tied|untied>_<backend>``: a tiny megatron-core ``GPTModel`` at TP=2: the fused mode
  (``use_fused_output_layer`` + ``fused_log_probs``) vs the stock path (logits +
  ``vocab_parallel_log_probs_and_entropy``): log-probs, entropies and every parameter gradient.
* ``fp32_head``: ``use_fp32_lm_head`` on a bf16 model: float32 logits, log-prob error vs float64 (from the
  same bf16 hidden states and weights) against the stock bf16 logits.
"""

from __future__ import annotations

import argparse
import json
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from _cpu import cpu_shim  # noqa: F401  (CPU patches for megatron-core)
from _output_layer_cases import reference_log_probs_and_entropy

from slime_tis.kernels.dispatch import KernelFallbackWarning
from slime_tis.kernels.output_layer import fused_log_probs_and_entropy

TEMPERATURE = 0.7
VOCAB, SEQ, HIDDEN, LAYERS, HEADS, ROWS = 64, 8, 32, 2, 4, 2


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def check_kernel(backend: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11)
    n_tok, hid, vocab = 27, 24, 70
    hidden = torch.randn(n_tok, hid, generator=g)
    weight = torch.randn(vocab, hid, generator=g) * 0.5
    targets = torch.randint(0, vocab, (n_tok,), generator=g)
    mask = (torch.rand(n_tok, generator=g) > 0.3).float()
    g_lp, g_ent = torch.randn(n_tok, generator=g), torch.randn(n_tok, generator=g)
    vp = vocab // world
    shard = weight[rank * vp:(rank + 1) * vp].clone().requires_grad_(True)
    h = hidden.clone().requires_grad_(True)
    lp, ent = fused_log_probs_and_entropy(h, shard, targets, temperature=TEMPERATURE, loss_mask=mask,
                                          tp_group=dist.group.WORLD, kernels=backend, chunk_size=16)
    (lp * g_lp + ent * g_ent).sum().backward()
    h64, w64 = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    lp_r, ent_r = reference_log_probs_and_entropy(h64, w64, targets, temperature=TEMPERATURE)
    ((lp_r * g_lp.double() + ent_r * g_ent.double()) * mask.double()).sum().backward()
    m = mask.double()
    return {"lp": float((lp.detach().double() - lp_r.detach() * m).abs().max()),
            "ent": float((ent.detach().double() - ent_r.detach() * m).abs().max()),
            "grad_hidden": _max_rel(h.grad, h64.grad),
            "grad_weight": _max_rel(shard.grad, w64.grad[rank * vp:(rank + 1) * vp])}


def _setup_tp2() -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(),
                                     create_gloo_process_groups=False)
    model_parallel_cuda_manual_seed(1234)


def _gpt(tied: bool, dtype: torch.dtype = torch.float32):
    from _cpu.cpu_cp_attention import CPUContextParallelAttention
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            tensor_model_parallel_size=dist.get_world_size(), params_dtype=dtype,
                            bf16=dtype == torch.bfloat16, pipeline_dtype=dtype)
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = CPUContextParallelAttention
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=True, post_process=True, share_embeddings_and_output_weights=tied)
    return model.to(dtype)


def _batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    mask = (torch.rand(ROWS, SEQ, generator=g) > 0.25).float()
    w_lp, w_ent = torch.randn(ROWS, SEQ, generator=g), torch.randn(ROWS, SEQ, generator=g)
    pos = torch.arange(SEQ)[None, :].expand(ROWS, SEQ)
    return tokens, pos, labels, mask, w_lp, w_ent


def check_gpt(tied: bool, backend: str) -> dict:
    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
    from slime_tis.megatron.output_layer import (
        fused_log_probs,
        output_layer_mode,
        restore_output_layer,
        use_fused_output_layer,
    )
    _setup_tp2()
    model = _gpt(tied)
    tokens, pos, labels, mask, w_lp, w_ent = _batch()

    def grads():
        out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out

    logits = model(tokens, pos, None)
    lp0, ent0 = vocab_parallel_log_probs_and_entropy(logits, labels, temperature=TEMPERATURE, tp_group="default")
    ((lp0 * w_lp + ent0 * w_ent) * mask).sum().backward()
    ref = grads()
    assert use_fused_output_layer(model) == 1 and output_layer_mode(model) == "fused"
    hidden = model(tokens, pos, None)
    if tied:  # flat labels and mask, as a TISBatch carries them
        lp1, ent1 = fused_log_probs(model, hidden, labels.reshape(-1), temperature=TEMPERATURE,
                                    loss_mask=mask.reshape(-1), kernels=backend, chunk_size=16)
        lp1, ent1 = lp1.view(ROWS, SEQ), ent1.view(ROWS, SEQ)
    else:
        lp1, ent1 = fused_log_probs(model, hidden, labels, temperature=TEMPERATURE, loss_mask=mask,
                                    kernels=backend, chunk_size=16)
    ((lp1 * w_lp + ent1 * w_ent) * mask).sum().backward()
    got = grads()
    restore_output_layer(model)
    assert output_layer_mode(model) is None
    restored = model(tokens, pos, None)
    errs = {n: _max_rel(got[n], ref[n]) for n in ref}
    worst = max(errs, key=errs.get)
    return {"hidden_shape": list(hidden.shape), "lp": float(((lp1 - lp0) * mask).detach().abs().max()),
            "ent": float(((ent1 - ent0) * mask).detach().abs().max()), "grad": errs[worst], "grad_param": worst,
            "same_params": sorted(got) == sorted(ref), "n_params": len(ref),
            "restored_logits": float((restored - logits).detach().abs().max()),
            "has_output_weight": model.output_layer.weight is not None}


def check_fp32_head() -> dict:
    from megatron.core import parallel_state as ps

    from slime_tis.engine.logprobs import vocab_parallel_log_probs_and_entropy
    from slime_tis.megatron.output_layer import restore_output_layer, use_fp32_lm_head, use_fused_output_layer
    _setup_tp2()
    model = _gpt(False, torch.bfloat16)
    tokens, pos, labels, mask, _, _ = _batch()
    with torch.no_grad():
        model.output_layer.weight.mul_(40.0)  # large logits, where bf16 rounding matters
        use_fused_output_layer(model)
        hidden = model(tokens, pos, None)
        restore_output_layer(model)
        bf16_logits = model(tokens, pos, None)
        use_fp32_lm_head(model)
        fp32_logits = model(tokens, pos, None)
        restore_output_layer(model)
        shards = [torch.empty_like(model.output_layer.weight) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, model.output_layer.weight.contiguous(), group=ps.get_tensor_model_parallel_group())
        full_w = torch.cat(shards)
        lp64, _ = reference_log_probs_and_entropy(hidden.double(), full_w.double(), labels, temperature=TEMPERATURE)
        kw = {"temperature": TEMPERATURE, "tp_group": "default"}
        lp_bf16, _ = vocab_parallel_log_probs_and_entropy(bf16_logits, labels, **kw)
        lp_fp32, _ = vocab_parallel_log_probs_and_entropy(fp32_logits, labels, **kw)
    return {"dtypes": [str(bf16_logits.dtype), str(fp32_logits.dtype)],
            "zmax": float((hidden.double() @ full_w.double().t()).abs().max()),
            "err_bf16": float((lp_bf16.double() - lp64).abs().max()),
            "err_fp32": float((lp_fp32.double() - lp64).abs().max())}


def check_errors() -> dict:
    """Misuse of the glue is a clear ValueError: fused log-probs on a stock model, switching modes blindly."""
    from slime_tis.megatron.output_layer import (
        fused_log_probs,
        restore_output_layer,
        use_fp32_lm_head,
        use_fused_output_layer,
    )
    _setup_tp2()
    model = _gpt(False)
    tokens, pos, labels, _, _, _ = _batch()
    out = {}
    for name, fn in {
        "not_fused": lambda: fused_log_probs(model, model(tokens, pos, None), labels),
        "mode_conflict": lambda: (use_fp32_lm_head(model), use_fused_output_layer(model)),
    }.items():
        try:
            fn()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    restore_output_layer(model)
    return out


def main() -> None:
    warnings.simplefilter("error", KernelFallbackWarning)  # kernels="triton" must run the kernels
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {}
    checks = {"kernel_torch": lambda: check_kernel("torch"), "kernel_triton": lambda: check_kernel("triton"),
              "gpt_untied_torch": lambda: check_gpt(False, "torch"),
              "gpt_tied_torch": lambda: check_gpt(True, "torch"),
              "gpt_tied_triton": lambda: check_gpt(True, "triton"),
              "fp32_head": check_fp32_head, "errors": check_errors}
    for name, fn in checks.items():
        try:
            results[name] = fn()
        except Exception:  # reported per check; the other checks still run
            results[name] = {"error": traceback.format_exc()}
    Path(args.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
