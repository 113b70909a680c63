"""The hook reduces over the process groups the schedule is handed (Megatron-LM >= 0.20 passes ``train_step``'s
``pg_collection`` to the schedule and all-reduces the logged loss over its ``dp_cp`` group), else over megatron's
``parallel_state`` groups. Runs in a child process with one gloo rank (a fresh torch.distributed state)."""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import types, sys
import torch.distributed as dist
from megatron.core import parallel_state as ps
from slime_tis.engine.reduce import reducer_for_schedule
dist.init_process_group("gloo", init_method="file://" + sys.argv[1] + "/store", rank=0, world_size=1)
ps.initialize_model_parallel()
own = types.SimpleNamespace(cp=dist.new_group([0]), dp=dist.new_group([0]), dp_cp=dist.new_group([0]))
r = reducer_for_schedule({"pg_collection": own, "p2p_communicator": None})
assert (r.cp_group, r.dp_group, r.dp_cp_group) == (own.cp, own.dp, own.dp_cp), "pg_collection's groups not used"
r = reducer_for_schedule({})
assert r.dp_cp_group is ps.get_data_parallel_group(with_context_parallel=True)
assert r.cp_group is ps.get_context_parallel_group()
print("ok")
"""


def test_reducer_uses_the_schedules_pg_collection(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
