"""Several jobs in one ``torchrun`` launch (``_batch_worker.py``): each job runs in a fresh process forked from a
worker that imported torch and megatron-core once, with a process group of its own, as if launched alone.

A torchrun launch of a small megatron job costs ~6 CPU-s of imports per process against ~1-3 s of work: tests
that start several such jobs with the same number of processes declare them as ``Job``s and launch them together
(typically from a module-scoped fixture), then assert on each job's outputs in their own test functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from _batch_worker import log_of
from _launch import free_port, torchrun

HERE = Path(__file__).resolve().parent
#: what the example's jobs import before their first line runs (the forked jobs then start without it)
EXAMPLE_PRELOAD = (
    "torch",
    "examples.rl.cpu_compat",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.dist_checkpointing",
    "megatron.core.models.gpt",
    "examples.rl.train",
    "examples.rl.checkpoint",
    "examples.rl.model",
)


@dataclass
class Job:
    """``argv`` as after ``python``: ``["-m", "module", *args]`` or ``[script, *args]``; ``timeout`` in seconds."""

    name: str
    argv: list[str]
    timeout: float = 240.0


@dataclass
class JobResult:
    name: str
    rcs: list[int | None]  # per rank; None: no record (the batch stopped before this job)
    logs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.rcs)

    def failure(self) -> str:
        """Why the job failed: the exit codes and the tail of each failing rank's output."""
        tails = "\n".join(f"--- rank {r} (rc={rc}):\n{log[-3000:]}" for r, (rc, log) in
                          enumerate(zip(self.rcs, self.logs, strict=True)) if rc != 0)
        return f"job {self.name} failed (-9: killed at its timeout):\n{tails}"


def torchrun_batch(jobs: list[Job], out: Path, *, nproc: int = 2, preload: tuple[str, ...] = EXAMPLE_PRELOAD,
                   env: dict | None = None, what: str = "batch") -> dict[str, JobResult]:
    """Run ``jobs`` one after another in one torchrun launch of ``nproc`` processes; results by job name.

    The launch fails the calling test only if the batch itself breaks (a failing job is recorded and the next one
    runs); its timeout is the sum of the jobs' timeouts plus a start-up allowance."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {"preload": list(preload), "out": str(out),
            "jobs": [{"name": j.name, "argv": [str(a) for a in j.argv], "port": free_port(), "timeout": j.timeout}
                     for j in jobs]}
    (out / "batch.json").write_text(json.dumps(spec))
    torchrun(HERE / "_batch_worker.py", [str(out / "batch.json")], nproc=nproc,
             timeout=sum(j.timeout for j in jobs) + 180, env=env, what=what)
    rcs: dict[str, list[int | None]] = {j.name: [None] * nproc for j in jobs}
    for rank in range(nproc):
        path = out / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            row = json.loads(line)
            rcs[row["name"]][rank] = row["rc"]
    results = {}
    for j in jobs:
        logs = []
        for rank in range(nproc):
            p = log_of(out, j.name, rank)
            logs.append(p.read_text(errors="replace") if p.exists() else "")
        results[j.name] = JobResult(j.name, rcs[j.name], logs)
    return results
