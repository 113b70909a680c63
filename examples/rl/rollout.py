"""One rollout step: sample prompts, query the engine with a SGLang ``/generate`` request, build the batch.

``backend`` is anything with ``generate(request) -> list[dict]``: the :class:`EmbeddedEngine` itself or an
:class:`SGLangClient` (``--sglang-url``); the request, the response parsing and the batch layout are
identical for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from examples.rl.batch import RolloutBatch, build_batch, parse_responses, routed_experts_rows
from examples.rl.task import EOS, DigitTask


class GenerateBackend(Protocol):
    def generate(self, request: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class RolloutSettings:
    prompts_per_step: int = 32
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 0
    std_normalize: bool = True
    #: MoE routing replay: ask for SGLang's ``return_routed_experts`` and carry them in the batch
    #: (``(num_layers, topk)`` of the model, or ``None``)
    routed_experts_shape: tuple[int, int] | None = None
    #: sampling-support replay: ask for SGLang's ``return_sampling_mask`` (each token's kept ids and its
    #: log-prob under the truncated distribution, used as pi_rollout) and carry the supports in the batch; the
    #: model's vocabulary size (ids are validated against it), or ``None``
    support_vocab_size: int | None = None


def step_seed(seed: int, step: int, salt: int) -> int:
    """Deterministic per-step seed (prompts and sampling are reproducible across resume)."""
    return (seed * 1_000_003 + step * 7919 + salt) % (2**62)


def make_request(prompts: torch.Tensor, task: DigitTask, s: RolloutSettings, sampling_seed: int) -> dict[str, Any]:
    """SGLang native ``/generate`` request for ``prompts [N, P]``."""
    return {
        "input_ids": prompts.tolist(),
        "sampling_params": {
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "max_new_tokens": task.max_new_tokens,
            "stop_token_ids": [EOS],
            "sampling_seed": sampling_seed,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        **({"return_routed_experts": True} if s.routed_experts_shape is not None else {}),
        **({"return_sampling_mask": True} if s.support_vocab_size is not None else {}),
    }


def collect_rollout(backend: GenerateBackend, task: DigitTask, s: RolloutSettings, step: int) -> RolloutBatch:
    """Sample ``prompts_per_step`` prompts, ``group_size`` responses each, and lay out the batch."""
    gen = torch.Generator().manual_seed(step_seed(s.seed, step, 1))
    prompts = task.sample_prompts(s.prompts_per_step, gen).repeat_interleave(s.group_size, dim=0)
    request = make_request(prompts, task, s, step_seed(s.seed, step, 2))
    responses = backend.generate(request)
    if not isinstance(responses, list) or len(responses) != prompts.shape[0]:
        got = len(responses) if isinstance(responses, list) else type(responses).__name__
        raise ValueError(f"/generate returned {got} responses for {prompts.shape[0]} prompts")
    packed = parse_responses(responses, request["sampling_params"], support_vocab_size=s.support_vocab_size)
    routed = None
    if s.routed_experts_shape is not None:
        routed = routed_experts_rows(responses, prompts.shape[1] + task.max_new_tokens, *s.routed_experts_shape)
    return build_batch(task, prompts, packed, s.group_size, std_normalize=s.std_normalize, routed_experts=routed)
