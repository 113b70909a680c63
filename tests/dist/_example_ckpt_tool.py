"""Helper processes for the example's dist-checkpoint tests (run as a script, never imported by pytest).

python _example_ckpt_tool.py plain CKPT_DIR OUT.pt [CKPT_DIR OUT.pt ...]
    every global tensor of each megatron dist checkpoint (``load_plain_tensors``, 1-process gloo group),
    flattened to ``{"model/<key>" | "optimizer/<key>": tensor}`` and saved to its OUT.pt (one process for
    all of them: the megatron import is most of its cost)
[torchrun ...] python _example_ckpt_tool.py reshard SRC_RUN_DIR STEP DST_RUN_DIR -- TRAIN_ARGS...
    build the example's model and optimizer at the layout of TRAIN_ARGS / the launch (``--pp``, world
    size), load SRC's checkpoint at STEP into it and save it again under DST: a load/save round trip
    through a different parallel layout
"""

from __future__ import annotations

import sys
import warnings

warnings.filterwarnings("ignore")


def plain(pairs: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from examples.rl.dist import init_distributed, shutdown

    init_distributed(pp=1)
    from megatron.core import dist_checkpointing

    for ckpt_dir, out in zip(pairs[::2], pairs[1::2], strict=True):
        flat = {}

        def walk(obj, prefix, flat=flat):
            if isinstance(obj, torch.Tensor):
                flat[prefix] = obj
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    walk(v, f"{prefix}/{k}" if prefix else str(k))

        walk(dist_checkpointing.load_plain_tensors(ckpt_dir), "")
        torch.save(flat, out)
    dist.barrier()
    shutdown()


def reshard(src: str, step: int, dst: str, train_args: list[str]) -> None:
    from examples.rl import checkpoint
    from examples.rl.dist import init_distributed, shutdown
    from examples.rl.train import Trainer, build_parser

    args = build_parser().parse_args(["--run-dir", dst, *train_args])
    info = init_distributed(pp=args.pp, seed=args.seed)
    try:
        trainer = Trainer(args, info)
        checkpoint.load(src, step, trainer.model, trainer.optimizer, load_extra=False)
        checkpoint.save(dst, step, trainer.model, trainer.optimizer, trainer.layout, None)
    finally:
        shutdown()


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "plain":
        plain(sys.argv[2:])
    elif cmd == "reshard":
        sep = sys.argv.index("--")
        reshard(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[sep + 1 :])
    else:
        raise SystemExit(f"unknown command {cmd!r}")
