"""One torchrun launch for the distributed tests: a free loopback port, a timeout that kills every process
of the launch (a hang fails the test, it never blocks CI), and the tail of the log on failure.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group never
reaches them: on timeout torchrun is stopped first (it cannot start or restart workers any more), then
every descendant, found through the parent links while they still exist, is killed with its own process
group. A process that left the tree (a double-forked daemon, re-parented to PID 1) is found by the tag
every process of the launch inherits in its environment (``LAUNCH_TAG``, unique per launch): after the
launch ends, in any way, every process still carrying the tag is killed, so no daemon outlives the test or
keeps the log pipe open. Only a process that replaces its whole environment escapes the tag.

Ports. A port taken from the kernel's ephemeral range (``bind(0)``) and released is free only for a moment: until
the launch binds it, any outgoing connection on the machine (gloo's mesh of the other pytest worker, pip) may take
it, and a batch's ports wait minutes before their job binds them. ``free_port`` therefore hands out ports from
below the ephemeral range, which the kernel never assigns by itself, each pytest-xdist worker from its own slice
and in turn, skipping any port something is bound to. A launch whose agent still finds its store's port taken
(another program on the machine) is started again on a fresh port, before any worker has run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
#: environment variable carrying a launch's tag (inherited by every process it starts, daemons included)
LAUNCH_TAG = "SLIME_TIS_TEST_LAUNCH"
POLL_S = 2.0  # how often a launch whose torchrun has exited is checked for a daemon holding the log pipe
LAUNCH_TRIES = 3  # starts of a launch whose agent found its store's port taken (EADDRINUSE), fresh port each
MIN_BAND = 4096  # the fewest ports outside the ephemeral range worth a band of their own


def _port_band() -> range:
    """The loopback ports ``free_port`` may hand out: below the kernel's ephemeral range (Linux:
    ``ip_local_port_range``, 32768-60999 by default), or above it where the room below is too small; empty where
    neither side has ``MIN_BAND`` ports."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    for band in (range(10000, low), range(high + 1, 65536)):
        if len(band) >= MIN_BAND:
            return band
    return range(0)


def _worker_slice() -> range:
    """This process's share of the band: pytest-xdist worker ``gwK`` of N gets slice K of N, so that two workers
    never hand out the same port."""
    band = _port_band()
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0) % count
    size = len(band) // count
    return range(band.start + index * size, band.start + (index + 1) * size)


_cursor: int | None = None  # the next index into this process's slice (starts at a pid-dependent place)


def free_port() -> int:
    """A loopback port for a launch's store or a test server: from this process's slice (see the module's
    docstring), in turn, and not bound by anything at the moment of the call. Where the ephemeral range leaves no
    band, the kernel's choice (``bind(0)``), whose race only the launch's restart covers."""
    global _cursor
    ports = _worker_slice()
    if not ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    if _cursor is None:
        _cursor = os.getpid() % len(ports)
    for _ in range(len(ports)):
        port = ports[_cursor]
        _cursor = (_cursor + 1) % len(ports)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # bound, or still in TIME_WAIT from a launch a moment ago
                continue
        return port
    raise RuntimeError(f"no free loopback port in {ports}")


def _store_port_taken(log: str) -> bool:
    """Did the launch fail because its agent could not listen on the store's port (before any worker ran)?"""
    return "EADDRINUSE" in log and "static_tcp_rendezvous" in log


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, every descendant (in whatever session) and their process groups."""
    try:
        root = psutil.Process(pid)
        root.suspend()  # no new worker (torchrun restarts failed ones) while the tree is listed
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    own_group = os.getpgrp()
    for proc in tree:
        try:
            group = os.getpgid(proc.pid)
            if group != own_group:  # never the test process's own group
                os.killpg(group, signal.SIGKILL)
            proc.kill()
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose environment carries ``LAUNCH_TAG=tag`` (other users' processes are unreadable
    and skipped)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(LAUNCH_TAG) == tag:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            pass
    return found


def kill_tagged(tag: str, *, rounds: int = 20) -> None:
    """SIGKILL every process carrying ``tag`` until none is left (a process forking meanwhile passes the tag to
    its child, which the next round finds)."""
    for _ in range(rounds):
        procs = tagged(tag)
        if not procs:
            return
        for proc in procs:
            try:
                proc.kill()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        psutil.wait_procs(procs, timeout=1.0)


def torchrun(
    script: Path | list[str],
    args: list[str],
    *,
    nproc: int = 2,
    timeout: float,
    env: dict | None = None,
    what: str = "torchrun",
) -> str:
    """Run ``torchrun --nproc-per-node nproc script *args`` from the repository root; return its log.

    ``script`` is a script path, or torchrun's own entry words such as ``["-m", "examples.rl.train"]``.

    ``env`` adds to the environment (``OMP_NUM_THREADS=1`` and ``PYTHONWARNINGS=ignore`` are always set,
    and the launch's tag). Fails the calling test when the launch times out or exits non-zero; no process of
    the launch survives it. A launch whose store's port was taken is started again (``LAUNCH_TRIES`` in all).
    """
    for _ in range(LAUNCH_TRIES):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *([str(script)] if isinstance(script, Path) else script),
            *args,
        ]
        returncode, log = _run_tagged(cmd, timeout=timeout, env=env, what=what)
        if returncode == 0 or not _store_port_taken(log):
            break
    if returncode != 0:
        pytest.fail(f"{what} failed (rc={returncode}):\n{log[-6000:]}")
    return log


def _run_tagged(cmd: list[str], *, timeout: float, env: dict | None, what: str) -> tuple[int, str]:
    """Run ``cmd`` under a fresh launch tag; its exit code and log. Fails the calling test on timeout."""
    tag = f"{os.getpid()}-{uuid.uuid4().hex}"
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {}), LAUNCH_TAG: tag}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                log, _ = proc.communicate(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                break
            except subprocess.TimeoutExpired:
                if proc.poll() is not None:  # torchrun has exited, a daemon of the launch still holds the pipe
                    kill_tagged(tag)
                if time.monotonic() >= deadline:
                    if proc.poll() is None:  # (never a reaped pid: it may belong to another process by now)
                        kill_tree(proc.pid)
                    kill_tagged(tag)
                    try:
                        log, _ = proc.communicate(timeout=10)
                    except subprocess.TimeoutExpired:  # a process that dropped the tag still holds the pipe
                        proc.kill()
                        proc.stdout.close()
                        proc.wait()
                        log = "(log unavailable: a process without the launch's tag kept its output pipe open)"
                    pytest.fail(f"{what} timed out after {timeout} s:\n{log[-4000:]}")
    finally:
        kill_tagged(tag)  # whatever outlived the launch (a daemon that closed its output)
    return proc.returncode, log


def rank_outputs(out: Path, nproc: int) -> list[dict]:
    """The JSON each rank of a launch wrote to ``out / rank{r}.json``, in rank order."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
