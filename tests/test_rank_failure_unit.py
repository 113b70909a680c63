"""The failure record of ``slime_tis.megatron.rank_failure`` against a stand-in for the job's store (the real
store under torchrun: ``tests/dist/test_rank_failure.py``): healthy calls touch nothing, an error of a rank's
own is recorded once and left unchanged, a broken connection is explained by another rank's record, and a
record is withdrawn when its rank goes on."""

from __future__ import annotations

import pytest

from slime_tis.megatron import rank_failure
from slime_tis.megatron.rank_failure import KEY, Phase, RankFailedError, reporting


class Store:
    """The store operations the module uses, on a dict shared by every "rank"; counts them."""

    def __init__(self, data: dict) -> None:
        self.data, self.ops = data, 0

    def check(self, keys):
        self.ops += 1
        return all(k in self.data for k in keys)

    def get(self, key):
        self.ops += 1
        return self.data[key].encode()

    def compare_set(self, key, expected, desired):
        self.ops += 1
        if key not in self.data or self.data[key] == expected:
            self.data[key] = desired
        return self.data[key].encode()

    def wait(self, keys, timeout):
        self.ops += 1
        raise TimeoutError("no key")

    def delete_key(self, key):
        self.ops += 1
        return self.data.pop(key, None) is not None


@pytest.fixture
def ranks(monkeypatch):
    """``as_rank(r)`` makes this process rank ``r`` of a job whose store is one shared dict."""
    data: dict = {}
    stores = {}

    def as_rank(r: int) -> Store:
        stores.setdefault(r, Store(data))
        monkeypatch.setattr(rank_failure, "_store", lambda: (stores[r], r))
        monkeypatch.setattr(rank_failure, "_recorded", [])
        return stores[r]

    as_rank.data = data
    return as_rank


def _call(phase_name: str, error: BaseException | None = None) -> None:
    with reporting(Phase("training call 3")) as phase:
        phase.name = phase_name
        if error is not None:
            raise error


def test_healthy_calls_touch_no_store(ranks):
    store = ranks(0)
    for _ in range(3):
        _call("the step totals")
    assert store.ops == 0 and ranks.data == {}


def test_the_survivor_names_the_failed_rank_phase_and_error(ranks):
    ranks(1)
    with pytest.raises(ValueError, match="^injected$"):  # the failing rank's own error is left as it is
        _call("the loss function", ValueError("injected"))
    assert ranks.data[KEY] == "rank 1 failed in the loss function of training call 3: ValueError: injected"
    ranks(0)
    gloo = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4000. This is typically caused "
                        "by a remote worker crashing.")
    with pytest.raises(RankFailedError) as e:
        _call("the step metrics", gloo)
    assert str(e.value) == ("rank 1 failed in the loss function of training call 3: ValueError: injected; this "
                            "rank (0) then stopped in the step metrics of training call 3: RuntimeError: "
                            "[pair.cc:553] Connection closed by peer [127.0.0.1]:4000. This is typically caused "
                            "by a remote worker crashing.")
    assert isinstance(e.value, RuntimeError) and e.value.__cause__ is gloo


def test_an_error_every_rank_raises_alike_stays_on_every_rank(ranks):
    for r in (0, 1):
        ranks(r)
        with pytest.raises(ValueError, match="^--tis-mode differs$"):
            _call("the settings check", ValueError("--tis-mode differs"))
    assert ranks.data[KEY].startswith("rank 0 failed in the settings check")  # the first record stands


def test_a_broken_connection_nobody_explains_stays_as_it_is(ranks):
    store = ranks(0)
    with pytest.raises(RuntimeError, match="^Connection reset by peer$"):
        _call("the step totals", RuntimeError("Connection reset by peer"))
    assert ranks.data == {} and store.ops >= 2  # looked (and waited) for a record, wrote none


def test_a_rank_that_goes_on_withdraws_its_record(ranks):
    ranks(1)
    with pytest.raises(ValueError):
        _call("reading the micro-batches", ValueError("bad item"))
    assert KEY in ranks.data
    _call("reading the micro-batches")  # its launcher went on: the next call withdraws the record
    assert ranks.data == {}
    ranks(0)
    with pytest.raises(RuntimeError, match="^Connection reset by peer$"):  # no stale explanation
        _call("the step totals", RuntimeError("Connection reset by peer"))


def test_no_process_group_leaves_errors_alone():
    assert rank_failure._store() is None  # this pytest process has no process group
    with pytest.raises(RuntimeError, match="^Connection reset by peer$"):
        _call("the step totals", RuntimeError("Connection reset by peer"))
