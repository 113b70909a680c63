"""The torchrun launcher of the distributed tests (``_launch.py``): a hanging worker fails the test within the
timeout and leaves no process behind; a launch that ends leaves none behind either; several jobs in one launch
(``_batch.py``) each get their own outcome; ports of two pytest workers never coincide, and a launch whose store's
port is taken starts again on another.

torchrun starts every worker in its own session, so killing torchrun's process group alone orphans the
workers, and they keep the log pipe open (the launcher would then block reading it). The worker here also
starts a grandchild in yet another session and a double-forked daemon (re-parented to PID 1, outside the
launch's process tree) that holds the log pipe.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import _launch
import psutil
import pytest
from _batch import Job, torchrun_batch
from _launch import free_port, torchrun

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 30.0  # long enough for torchrun (a torch import) to start both workers on a loaded machine
CLEANUP_S = 20.0  # the launcher's own work after the timeout: kill, reap, read the log


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(out: Path) -> list[int]:
    return [int(p) for f in sorted(out.glob("pids*")) if not f.name.endswith(".tmp") for p in f.read_text().split()]


def _kill_left(pids: list[int]) -> None:
    """Never leave a test process behind, whatever the launcher did."""
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _wait_dead(pids: list[int], seconds: float = 5.0) -> list[int]:
    """The pids still alive after ``seconds`` (SIGKILL is asynchronous: give the kernel a moment)."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_timeout_kills_every_worker_and_returns(tmp_path):
    outcome: list[BaseException | str] = []

    def launch():
        try:
            torchrun(HERE / "hang_worker.py", ["--out", str(tmp_path)], nproc=2, timeout=TIMEOUT_S,
                     what="hanging workers")
            outcome.append("returned")
        except BaseException as e:  # pytest.fail raises a BaseException
            outcome.append(e)

    start = time.monotonic()
    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    thread.join(TIMEOUT_S + CLEANUP_S)
    elapsed = time.monotonic() - start
    pids = _pids(tmp_path)
    try:
        assert len(pids) == 6, f"the workers did not start within {TIMEOUT_S} s (pid files: {pids})"
        assert not thread.is_alive(), f"the launcher still blocks {elapsed:.0f} s after a {TIMEOUT_S} s timeout"
        assert len(outcome) == 1 and isinstance(outcome[0], pytest.fail.Exception), outcome
        assert "timed out" in str(outcome[0])
        assert "log unavailable" not in str(outcome[0]), "a daemon of the launch kept the log pipe open"
        assert not _wait_dead(pids), "processes of the launch survived its timeout (worker, child, daemon per rank)"
    finally:
        _kill_left(pids)


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_launch_that_ends_leaves_no_daemon_and_returns_at_once(tmp_path):
    """Workers that exit 0 right after double-forking a daemon (which holds the log pipe): the launch succeeds
    as soon as torchrun has exited (at its timeout it would fail), and the daemon and the orphaned child are gone."""
    try:
        torchrun(HERE / "hang_worker.py", ["--out", str(tmp_path), "--exit"], nproc=2, timeout=TIMEOUT_S + CLEANUP_S,
                 what="workers leaving a daemon")
        pids = _pids(tmp_path)
        assert len(pids) == 6, pids
        assert not _wait_dead(pids), "processes of the launch outlived it (worker, child, daemon per rank)"
    finally:
        _kill_left(_pids(tmp_path))


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_batch_records_each_job_and_runs_the_next(tmp_path):
    """Several jobs in one launch (``_batch.py``): a job that exits 3 and one that hangs past its timeout are
    recorded as such on every rank, and the jobs after them still run, each in a process group of its own."""
    job = HERE / "batch_job.py"
    jobs = [Job("fail", [job, "fail", tmp_path]), Job("hang", [job, "hang", tmp_path], timeout=5.0),
            Job("ok", [job, "ok", tmp_path]), Job("ok_again", [job, "ok", tmp_path / "again"])]
    (tmp_path / "again").mkdir()
    results = torchrun_batch(jobs, tmp_path / "batch", preload=("torch", "torch.distributed"), what="batch")
    assert results["fail"].rcs == [3, 3] and not results["fail"].ok
    assert results["hang"].rcs == [-9, -9], results["hang"].rcs
    assert results["ok"].ok and results["ok_again"].ok, (results["ok"].failure(), results["ok_again"].failure())
    for d in (tmp_path, tmp_path / "again"):  # ranks 1 + 2 summed by the job's own all-reduce
        assert [(d / f"ok.rank{r}").read_text() for r in (0, 1)] == ["3 2", "3 2"]


def test_free_port_slices_are_disjoint_and_skip_a_bound_port(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    slices = []
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        slices.append(set(_launch._worker_slice()))
    if not _launch._port_band():
        pytest.skip("the kernel's ephemeral port range leaves no band outside it (free_port uses bind(0))")
    assert slices[0] and slices[1] and not slices[0] & slices[1]
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(p < low or p > high for p in slices[0] | slices[1]), "a port of the kernel's ephemeral range"
    monkeypatch.setattr(_launch, "_cursor", None)
    first = free_port()
    monkeypatch.setattr(_launch, "_cursor", None)  # the same cursor again: ``first`` is next, but now bound
    with socket.socket() as held:
        held.bind(("127.0.0.1", first))
        held.listen()
        second = free_port()
    assert second != first and second in slices[1]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_launch_whose_port_is_taken_starts_again_on_another(tmp_path, monkeypatch):
    """The first port handed to the launch is held by a listening socket (another program took it after
    ``free_port`` looked): torchrun's agent cannot listen, and the launch runs again on a fresh port. A launch
    that fails for another reason runs once. (One worker: the agent's store is what is tested.)"""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    given, taken, real = [], iter([held.getsockname()[1]]), _launch.free_port

    def port_taken_first() -> int:
        given.append(next(taken, None) or real())
        return given[-1]

    monkeypatch.setattr(_launch, "free_port", port_taken_first)
    try:
        torchrun(HERE / "batch_job.py", ["ok", tmp_path], nproc=1, timeout=TIMEOUT_S + CLEANUP_S, what="port taken")
    finally:
        held.close()
    assert len(given) == 2 and given[0] != given[1]
    assert (tmp_path / "ok.rank0").read_text() == "1 1"
    given.clear()
    with pytest.raises(pytest.fail.Exception, match="rc=1"):
        torchrun(HERE / "batch_job.py", ["fail", tmp_path], nproc=1, timeout=TIMEOUT_S + CLEANUP_S, what="exit 3")
    assert len(given) == 1
