"""NaN logits stay NaN on the GPU's max semantics, not only under Triton's interpreter.

PTX ``max.f32`` / ``min.f32`` (what ``tl.maximum`` / ``tl.minimum`` compile to) return the non-NaN operand; the
interpreter's ``np.maximum`` keeps the NaN, so a kernel that relies on ``maximum`` propagating a NaN passes the CPU
tests and turns a diverged row into a finite log-prob on a GPU (the core's non-finite rejection then never fires).
Here the kernels run under ``TRITON_INTERPRET=1`` with the interpreter's elementwise max/min replaced by
``np.fmax`` / ``np.fmin`` (the GPU's NaN-dropping semantics; its reductions already use ``np.nanmax``), in a child
process: a row with a NaN logit (in the target column or elsewhere), or a NaN hidden state for the output layer,
must give NaN log-prob, entropy and gradient row (as the torch reference does), the other rows the torch
reference's values and finite gradients."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")

CHILD = r"""
import numpy as np
import torch
from triton.runtime import interpreter

B = interpreter.InterpreterBuilder
B.create_maximumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
B.create_minimumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)
B.create_maxnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmax)
B.create_minnumf = lambda self, lhs, rhs: self.binary_op(lhs, rhs, np.fmin)

from slime_tis.kernels import logprobs, output_layer

torch.manual_seed(0)
T, V, H = 6, 40, 16
logits = torch.randn(T, V) * 3
targets = torch.randint(0, V, (T,))
logits[1, (targets[1] + 7) % V] = float("nan")   # a NaN away from the target
logits[2, targets[2]] = float("nan")             # a NaN target logit
logits[3, :] = float("nan")                      # a whole NaN row
logits.requires_grad_(True)
lp, ent = logprobs.fused_log_probs_and_entropy(logits, targets, block_v=16)
ref = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
bad = [1, 2, 3]
good = [0, 4, 5]
assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all(), ("logprobs kernel", lp, ent)
assert torch.allclose(lp[good], ref[good], atol=1e-5), (lp, ref)
# backward: the gradient rows of NaN rows are NaN (as the torch reference's), the others finite
(lp.sum() + ent.sum()).backward()
assert torch.isnan(logits.grad[bad]).any(1).all() and torch.isfinite(logits.grad[good]).all(), logits.grad

hidden = torch.randn(T, H)
weight = torch.randn(V, H) * 0.3
hidden[1, 3] = float("nan")
h = hidden.clone().requires_grad_(True)
lp, ent = output_layer.fused_log_probs_and_entropy(h, weight, targets, kernels="triton")
lp.sum().backward()  # the log-prob term alone: no entropy term carries the NaN
assert torch.isnan(h.grad[1]).any() and torch.isfinite(h.grad[[0, 2, 3, 4, 5]]).all(), ("output-layer backward", h.grad)

lp, ent = output_layer.fused_log_probs_and_entropy(hidden, weight, targets, kernels="triton")
assert torch.isnan(lp[1]) and torch.isnan(ent[1]), ("output-layer kernel", lp, ent)
from _output_layer_cases import reference_log_probs_and_entropy
ref_lp, _ = reference_log_probs_and_entropy(hidden, weight, targets)
assert torch.allclose(lp[[0, 2, 3, 4, 5]].double(), ref_lp[[0, 2, 3, 4, 5]].double(), atol=1e-4), (lp, ref_lp)
from slime_tis.kernels import correction

lt, lr = torch.randn(10), torch.randn(10)
lt[2], lr[7] = float("nan"), float("inf")
valid = torch.ones(10, dtype=torch.bool)
offsets = torch.tensor([0, 4, 6, 10])
l_out, sums = correction.sequence_sums(lt, lr, valid, offsets, block=4)
assert torch.isnan(sums[0, 0]) and torch.isfinite(sums[1]).all() and not torch.isfinite(sums[2, :2]).all(), sums
print("ok")
"""


def test_nan_rows_stay_nan_under_gpu_max_semantics():
    paths = os.pathsep.join((str(ROOT), str(ROOT / "tests")))
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": paths}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
