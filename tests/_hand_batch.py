"""The hand batch the core's formula tests compute by hand: sequence A = tokens 0..2, B = tokens 3..4 (token 4
masked, NaN everywhere), token ratios ``r = pi_train / pi_rollout = [3, 0.25, 1.5, 0.8]``."""

from __future__ import annotations

import math

import torch

NAN = float("nan")
CU = torch.tensor([0, 3, 5])
MASK = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
LP_ROLLOUT = torch.tensor([-1.0, -1.0, -1.0, -2.0, NAN])
R = [3.0, 0.25, 1.5, 0.8]
LP_TRAIN = LP_ROLLOUT + torch.tensor([math.log(x) for x in R] + [NAN])
