"""Synthetic digit task with an exactly computable reward.

Vocabulary (``VOCAB_SIZE = 16``): ids 0-9 are the digits, ``SEP = 10`` ends the prompt,
``EOS = 11`` ends the response; ids 12-15 are unused padding ids the policy can still emit
(they count as wrong answers).

A prompt is ``n`` random digits followed by ``SEP``; the target is a deterministic transformation of
the digits (``copy``, ``reverse``, ``increment`` = each digit + 1 mod 10, or ``sort``). The response is
up to ``n + 1`` generated tokens. The reward of a response is

    reward = (1 / n) * sum_{i < n} [response[i] == target[i]]

i.e. the exact fraction of target digits produced at the right position (tokens after an ``EOS``
are ignored, a missing position counts as wrong). A uniformly random policy over the 16 ids scores
1/16 in expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NUM_DIGITS = 10
SEP = 10
EOS = 11
VOCAB_SIZE = 16
TRANSFORMS = ("copy", "reverse", "increment", "sort")


@dataclass(frozen=True)
class DigitTask:
    """The task definition: ``num_digits`` per prompt and the ``transform`` to apply."""

    num_digits: int = 3
    transform: str = "reverse"

    def __post_init__(self) -> None:
        if self.num_digits < 1:
            raise ValueError(f"num_digits must be >= 1, got {self.num_digits}")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"transform must be one of {TRANSFORMS}, got {self.transform!r}")

    @property
    def prompt_len(self) -> int:
        return self.num_digits + 1

    @property
    def max_new_tokens(self) -> int:
        return self.num_digits + 1

    @property
    def max_seq_len(self) -> int:
        return self.prompt_len + self.max_new_tokens

    def sample_prompts(self, num_prompts: int, generator: torch.Generator) -> torch.Tensor:
        """Random prompts, ``[num_prompts, num_digits + 1]`` int64 (digits then ``SEP``)."""
        digits = torch.randint(0, NUM_DIGITS, (num_prompts, self.num_digits), generator=generator)
        sep = torch.full((num_prompts, 1), SEP, dtype=torch.long)
        return torch.cat([digits, sep], dim=1)

    def targets(self, prompts: torch.Tensor) -> torch.Tensor:
        """Target digits ``[B, num_digits]`` for prompts ``[B, num_digits + 1]``."""
        digits = prompts[:, : self.num_digits]
        if self.transform == "copy":
            return digits.clone()
        if self.transform == "reverse":
            return digits.flip(1)
        if self.transform == "increment":
            return (digits + 1) % NUM_DIGITS
        return digits.sort(dim=1).values

    def rewards(self, prompts: torch.Tensor, responses: list[list[int]]) -> torch.Tensor:
        """Exact rewards ``[B]`` float32 (see module docstring) for generated token id lists."""
        if len(responses) != prompts.shape[0]:
            raise ValueError(f"responses has {len(responses)} entries but prompts has {prompts.shape[0]} rows")
        n = self.num_digits
        padded = torch.full((len(responses), n), -1, dtype=torch.long)
        for i, resp in enumerate(responses):  # building a [B, n] table from ragged lists (host data)
            cut = resp.index(EOS) if EOS in resp else len(resp)
            body = resp[: min(cut, n)]
            if body:
                padded[i, : len(body)] = torch.tensor(body, dtype=torch.long)
        return (padded == self.targets(prompts)).float().mean(dim=1)
