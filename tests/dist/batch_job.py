"""A job of ``test_launch.py``'s batch check: ``python batch_job.py MODE OUT``.

``ok``: join the job's process group (gloo, from the environment), all-reduce this rank's number and write the sum
to ``OUT/ok.rank{R}``; ``fail``: exit 3; ``hang``: sleep far past the job's timeout.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

mode, out = sys.argv[1], Path(sys.argv[2])
if mode == "fail":
    raise SystemExit(3)
if mode == "hang":
    time.sleep(3600)
dist.init_process_group("gloo")
x = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(x)
(out / f"ok.rank{dist.get_rank()}").write_text(f"{x.item():g} {dist.get_world_size()}")
dist.destroy_process_group()
