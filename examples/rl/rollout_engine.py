"""Embedded rollout engine: SGLang ``/generate`` semantics on the plain-torch KV-cache decoder.

Requests and responses have the shape of SGLang's native ``/generate`` API with ``return_logprob``:

request::

    {"input_ids": [[...], ...] or [...],
     "sampling_params": {"temperature": 1.0, "max_new_tokens": 5, "stop_token_ids": [11],
                         "top_p": 1.0, "top_k": -1, "sampling_seed": 1234},
     "return_logprob": true, "return_routed_experts": false}

response (one dict per prompt; a list when ``input_ids`` is a list of lists)::

    {"text": "", "output_ids": [7, 3, 11],
     "meta_info": {"id": "...", "prompt_tokens": 5, "completion_tokens": 3,
                   "finish_reason": {"type": "stop", "matched": 11} | {"type": "length", "length": 5},
                   "output_token_logprobs": [[logprob, token_id, None], ...],
                   "routed_experts": "<base64>"}}     (only with return_routed_experts, MoE models)

``routed_experts`` follows SGLang's ``return_routed_experts``: the experts the engine's router chose for every
token it ran through the model (the prompt and every output token but the last: ``prompt_tokens +
completion_tokens - 1`` positions), as base64 of little-endian int32 ``[positions, num_layers, topk]``
(:func:`decode_routed_experts`).

As in SGLang, the reported log-prob is ``log_softmax(logits / temperature)`` of the sampled token over
the full vocabulary (top-p/top-k change what is sampled, not the reported log-prob), and the stop
token is included in ``output_ids`` / ``output_token_logprobs``.

Sampling follows SGLang's order: temperature, then top-k, then top-p on the top-k-renormalised distribution
(:func:`_filter_probs`). With ``"return_sampling_mask": true`` the response also carries, as SGLang >= 0.5.23
does in its default ``"selected"`` mode, ``output_token_sampling_mask`` (the kept ids of each token, ascending)
and ``output_token_sampling_logprobs`` (the sampled token's log-prob under the truncated, renormalised
distribution it was drawn from: ``log p(y) - log sum_{v kept} p(v)``), and ``output_token_sampling_mask_length``.

Numerics: bfloat16 incremental decoding (``dtype``), optionally with Gaussian logit noise of std
``logit_noise`` added before sampling (a stronger, controllable training/inference mismatch; the noisy
logits define the behaviour policy, so the reported log-probs are exact for what was sampled).
``quant`` = ``int8`` / ``fp8`` / ``fp8-tensor`` serves weight-only quantized linear layers (dequantized on
the fly into the decode dtype, :mod:`examples.rl.quant`): the quantized-rollout mismatch. ``lm_head_fp32``
computes the output projection and logits in float32 (the inference-side LM-head fix).
Sampling is reproducible: with ``sampling_seed`` the same request gives the same response.
"""

from __future__ import annotations

import base64
import itertools
import math
import threading
from typing import Any

import torch

from examples.rl.model import KVCacheGPT, ModelConfig, load_hf_checkpoint

_request_ids = itertools.count()


class EngineNotReadyError(RuntimeError):
    """``generate`` was called before any weights were loaded."""


class EmbeddedEngine:
    """In-process rollout engine (one weight version; staleness is handled by the weight sync).

    Args:
        cfg: architecture (must match the weights pushed later).
        dtype: decode dtype (``torch.bfloat16`` default; ``torch.float32`` removes the bf16 mismatch).
        logit_noise: std of Gaussian noise added to the decode logits (0 = off).
        device: where decoding runs.
        quant: ``"none"`` or a weight-only scheme of :data:`examples.rl.quant.SCHEMES`.
        lm_head_fp32: LM head (output matmul and logits) in float32.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        dtype: torch.dtype = torch.bfloat16,
        logit_noise: float = 0.0,
        device: torch.device | str = "cpu",
        quant: str = "none",
        lm_head_fp32: bool = False,
    ) -> None:
        from examples.rl.quant import ENGINE_QUANT_CHOICES

        if logit_noise < 0:
            raise ValueError(f"logit_noise must be >= 0, got {logit_noise}")
        if quant not in ENGINE_QUANT_CHOICES:
            raise ValueError(f"quant must be one of {ENGINE_QUANT_CHOICES}, got {quant!r}")
        self.cfg, self.dtype, self.logit_noise, self.device = cfg, dtype, float(logit_noise), device
        self.quant, self.lm_head_fp32 = quant, bool(lm_head_fp32)
        self._model: KVCacheGPT | None = None
        self._lock = threading.Lock()
        self.weight_version = 0

    # ------------------------------------------------------------------ weight updates
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """In-process weight update (tensors are copied and cast to the decode dtype)."""
        model = KVCacheGPT(
            self.cfg, weights, dtype=self.dtype, device=self.device, quant=self.quant, lm_head_fp32=self.lm_head_fp32
        )
        with self._lock:
            self._model = model
            self.weight_version += 1

    def update_weights_from_disk(self, model_path: str, *, files: dict[str, str] | None = None) -> dict[str, Any]:
        """SGLang ``/update_weights_from_disk`` semantics: load a checkpoint directory written by
        :func:`examples.rl.model.save_hf_checkpoint`; returns ``{"success", "message"}``. ``files``: the
        resolved path of each file to read (``load_hf_checkpoint``), as the HTTP server checked them."""
        try:
            cfg, weights = load_hf_checkpoint(model_path, files=files)
            if cfg != self.cfg:
                return {"success": False, "message": f"architecture {cfg} does not match engine {self.cfg}"}
            self.load_weights(weights)
        except (OSError, ValueError, KeyError, RuntimeError) as e:
            return {"success": False, "message": f"failed to load weights from {model_path!r}: {e}"}
        return {"success": True, "message": f"loaded {model_path}", "weight_version": self.weight_version}

    # ------------------------------------------------------------------ generation
    def generate(self, request: dict[str, Any]) -> dict[str, Any] | list[dict[str, Any]]:
        """Serve one ``/generate`` request (see module docstring)."""
        with self._lock:
            model = self._model
        if model is None:
            raise EngineNotReadyError("no weights loaded yet; push weights with update_weights first")
        if not isinstance(request, dict):
            raise ValueError(f"the request must be a JSON object, got {type(request).__name__}")
        ids = request.get("input_ids")
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"input_ids must be a non-empty list of token ids or of lists, got {type(ids).__name__}")
        single = not isinstance(ids[0], list)
        prompts = [ids] if single else ids
        for i, prompt in enumerate(prompts):
            self._check_prompt(prompt, "input_ids" if single else f"input_ids[{i}]")
        sp = request.get("sampling_params")
        if sp is not None and not isinstance(sp, dict):
            raise ValueError(f"sampling_params must be a JSON object, got {type(sp).__name__}")
        params = _SamplingParams.parse(sp or {}, self.cfg.vocab_size)
        if request.get("return_logprob", False) is not True:
            raise ValueError("the embedded engine only serves return_logprob=true requests")
        want_support = request.get("return_sampling_mask", False)
        if not isinstance(want_support, bool):
            raise ValueError(f"return_sampling_mask must be true or false, got {_short(want_support)}")
        want_routes = request.get("return_routed_experts", False)
        if not isinstance(want_routes, bool):
            raise ValueError(f"return_routed_experts must be true or false, got {_short(want_routes)}")
        if want_routes and not self.cfg.is_moe:
            raise ValueError("return_routed_experts=true needs a mixture-of-experts model; this engine's is dense")
        gen = torch.Generator().manual_seed(params.seed)
        out = [None] * len(prompts)
        by_len: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):  # group prompts of equal length into one batch (host data)
            by_len.setdefault(len(p), []).append(i)
        for length in sorted(by_len):
            rows = by_len[length]
            batch = torch.tensor([prompts[i] for i in rows], dtype=torch.long)
            results = self._decode(model, batch, params, gen, want_routes, want_support)
            for i, res in zip(rows, results):
                out[i] = res
        return out[0] if single else out

    def _check_prompt(self, prompt: Any, name: str) -> None:
        """A prompt: 1 to ``max_seq_len - 1`` token ids, each an int in ``[0, vocab_size)`` (a negative id would
        index the embedding from the end, an id >= vocab_size past it)."""
        v, limit = self.cfg.vocab_size, self.cfg.max_seq_len - 1
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"{name} must be a non-empty list of token ids, got {_short(prompt)}")
        if len(prompt) > limit:
            raise ValueError(
                f"{name} has {len(prompt)} tokens; the model holds {self.cfg.max_seq_len} positions, "
                f"so a prompt has at most {limit}"
            )
        for t, tok in enumerate(prompt):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < v:
                raise ValueError(f"{name}[{t}] = {_short(tok)} is not a token id in [0, {v})")

    def _decode(
        self, model: KVCacheGPT, prompts: torch.Tensor, p: _SamplingParams, gen: torch.Generator, want_routes: bool,
        want_support: bool = False,
    ) -> list[dict[str, Any]]:
        """Incremental decoding of a batch of equal-length prompts ``[B, P]``."""
        b, plen = prompts.shape
        max_new = min(p.max_new_tokens, self.cfg.max_seq_len - plen)
        steps: list[torch.Tensor] = []  # per forward call: experts [B, L, num_layers, k]

        def run(tokens: torch.Tensor, start: int, cache: Any) -> tuple[torch.Tensor, Any]:
            routes: list[torch.Tensor] | None = [] if want_routes else None
            logits, cache = model.forward(tokens.to(model.device), start, cache, routes)
            if routes is not None:
                steps.append(torch.stack(routes, dim=2).cpu())
            return logits, cache

        logits, cache = run(prompts, 0, None)
        last = logits[:, -1]
        tokens = torch.zeros(b, max_new, dtype=torch.long)
        logps = torch.zeros(b, max_new, dtype=torch.float32)
        sampling_logps = torch.zeros(b, max_new, dtype=torch.float32)
        kept: list[torch.Tensor] = []  # per step: [B, V] bool, the support each token was drawn from
        done = torch.zeros(b, dtype=torch.bool)
        lengths = torch.full((b,), max_new, dtype=torch.long)
        stop = torch.tensor(p.stop_token_ids, dtype=torch.long)
        for t in range(max_new):
            if self.logit_noise > 0:
                last = last + self.logit_noise * torch.randn(last.shape, generator=gen).to(last.device)
            scaled = last.float().cpu() / p.temperature
            logp_full = torch.log_softmax(scaled, dim=-1)
            probs = _filter_probs(logp_full.exp(), p.top_p, p.top_k)
            tok = torch.multinomial(probs, 1, generator=gen).squeeze(1)
            tokens[:, t] = tok
            logps[:, t] = logp_full.gather(1, tok[:, None]).squeeze(1)
            if want_support:
                keep = probs > 0
                log_mass = torch.logsumexp(logp_full.masked_fill(~keep, float("-inf")), dim=-1)
                sampling_logps[:, t] = logps[:, t] - log_mass
                kept.append(keep)
            hit = torch.isin(tok, stop) & ~done
            lengths = torch.where(hit, torch.full_like(lengths, t + 1), lengths)
            done |= hit
            if bool(done.all()) or t == max_new - 1:  # host-sync-ok (engine control flow)
                break
            logits, cache = run(tok[:, None], plen + t, cache)
            last = logits[:, -1]
        routed = torch.cat(steps, dim=1).to(torch.int32) if want_routes else None  # [B, P + fed, num_layers, k]
        out = []
        for i in range(b):  # build per-prompt JSON-able responses (host data)
            n = int(lengths[i])
            ids = tokens[i, :n].tolist()
            stopped = bool(done[i])
            out.append(
                {
                    "text": "",
                    "output_ids": ids,
                    "meta_info": {
                        "id": f"embedded-{next(_request_ids)}",
                        "prompt_tokens": plen,
                        "completion_tokens": n,
                        "finish_reason": (
                            {"type": "stop", "matched": ids[-1]} if stopped else {"type": "length", "length": n}
                        ),
                        "output_token_logprobs": [[lp, tid, None] for lp, tid in zip(logps[i, :n].tolist(), ids)],
                        **({"routed_experts": encode_routed_experts(routed[i, : plen + n - 1])} if want_routes else {}),
                        **(_sampling_mask_meta([k[i] for k in kept[:n]], sampling_logps[i, :n]) if want_support
                           else {}),
                    },
                }
            )
        return out


def _sampling_mask_meta(kept: list[torch.Tensor], sampling_logps: torch.Tensor) -> dict[str, Any]:
    """SGLang's ``return_sampling_mask`` fields of one response ("selected" mode)."""
    mask = [k.nonzero().flatten().tolist() for k in kept]
    return {"output_token_sampling_mask": mask, "output_token_sampling_logprobs": sampling_logps.tolist(),
            "output_token_sampling_mask_length": len(mask)}


def encode_routed_experts(experts: torch.Tensor) -> str:
    """``experts [positions, num_layers, k]`` -> base64 of little-endian int32 (SGLang's wire format)."""
    return base64.b64encode(experts.to(torch.int32).contiguous().numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, topk: int) -> torch.Tensor:
    """Inverse of :func:`encode_routed_experts`: int64 ``[positions, num_layers, topk]``; raises ``ValueError``
    naming the sizes when the payload is not a whole number of positions."""
    import numpy as np

    try:
        raw = base64.b64decode(data, validate=True)
    except (ValueError, TypeError) as e:
        raise ValueError(f"routed_experts is not base64: {e}") from e
    per_pos = 4 * num_layers * topk
    if len(raw) % per_pos:
        raise ValueError(
            f"routed_experts has {len(raw)} bytes, not a multiple of 4 x num_layers ({num_layers}) x "
            f"topk ({topk}) = {per_pos}"
        )
    arr = np.frombuffer(raw, dtype="<i4").astype("int64").reshape(-1, num_layers, topk)
    return torch.from_numpy(arr.copy())


class _SamplingParams:
    """Validated subset of SGLang's sampling parameters that the engine honours."""

    def __init__(
        self,
        temperature: float,
        max_new_tokens: int,
        stop_token_ids: list[int],
        top_p: float,
        top_k: int,
        seed: int,
    ) -> None:
        self.temperature, self.max_new_tokens, self.stop_token_ids = (
            temperature,
            max_new_tokens,
            stop_token_ids,
        )
        self.top_p, self.top_k, self.seed = top_p, top_k, seed

    @classmethod
    def parse(cls, sp: dict[str, Any], vocab_size: int) -> _SamplingParams:
        temperature = _real(sp, "temperature", 1.0)
        if temperature <= 0:
            raise ValueError(f"sampling_params.temperature must be > 0 (greedy is not served), got {temperature}")
        max_new = _int(sp, "max_new_tokens", 16)
        if max_new < 1:
            raise ValueError(f"sampling_params.max_new_tokens must be >= 1, got {max_new}")
        top_p = _real(sp, "top_p", 1.0)
        if not 0 < top_p <= 1:
            raise ValueError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
        top_k = _int(sp, "top_k", -1)
        seed = sp.get("sampling_seed")
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())  # host-sync-ok
        else:
            seed = _int(sp, "sampling_seed", 0)
            if not 0 <= seed < 2**63:
                raise ValueError(f"sampling_params.sampling_seed must be in [0, 2**63), got {seed}")
        stops = sp.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in stops
        ):
            raise ValueError(
                f"sampling_params.stop_token_ids must be a list of token ids in [0, {vocab_size}), got {_short(stops)}"
            )
        return cls(temperature, max_new, list(stops), top_p, top_k, seed)


def _real(sp: dict[str, Any], key: str, default: float) -> float:
    """A finite number (JSON's ``NaN`` / ``Infinity`` and non-numbers are errors)."""
    v = sp.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"sampling_params.{key} must be a finite number, got {_short(v)}")
    return float(v)


def _int(sp: dict[str, Any], key: str, default: int) -> int:
    v = sp.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"sampling_params.{key} must be an integer, got {_short(v)}")
    return v


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _filter_probs(probs: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """Top-k then top-p (nucleus) filtering of ``probs [B, V]``; returns unnormalised kept mass."""
    if top_k > 0:
        kth = probs.topk(min(top_k, probs.shape[-1]), dim=-1).values[:, -1:]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < top_p * probs.sum(-1, keepdim=True)
        keep = torch.zeros_like(keep_sorted).scatter(1, idx, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    return probs
