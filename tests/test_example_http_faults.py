"""The example engine's HTTP server and client under hostile or broken peers (127.0.0.1 only, bounded time):
who may load weights, request sizes, idle and trickling connections, malformed bodies, concurrency."""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from examples.rl.http_client import SGLangClient, SGLangHTTPError
from examples.rl.http_server import serve
from examples.rl.model import ModelConfig, save_hf_checkpoint
from examples.rl.rollout_engine import EmbeddedEngine
from examples.rl.task import EOS, SEP

CFG = ModelConfig(num_layers=1, hidden_size=16, num_heads=2, max_seq_len=12)
REQ = {"input_ids": [1, 2, SEP], "return_logprob": True,
       "sampling_params": {"max_new_tokens": 3, "sampling_seed": 1, "stop_token_ids": [EOS]}}


def random_weights(cfg: ModelConfig = CFG, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random GPT-2-layout weights of ``cfg`` (any values: these tests check the transport, not the model)."""
    g = torch.Generator().manual_seed(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    w = {
        "transformer.wte.weight": torch.randn(v, h, generator=g),
        "transformer.wpe.weight": torch.randn(cfg.max_seq_len, h, generator=g),
        "transformer.ln_f.weight": torch.ones(h),
        "transformer.ln_f.bias": torch.zeros(h),
    }
    shapes = {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h), "mlp.c_fc": (h, 4 * h), "mlp.c_proj": (4 * h, h)}
    for i in range(cfg.num_layers):
        p = f"transformer.h.{i}."
        for ln in ("ln_1", "ln_2"):
            w[p + ln + ".weight"], w[p + ln + ".bias"] = torch.ones(h), torch.zeros(h)
        for name, shape in shapes.items():
            w[p + name + ".weight"] = 0.1 * torch.randn(*shape, generator=g)
            w[p + name + ".bias"] = torch.zeros(shape[1])
    return w


def _engine() -> EmbeddedEngine:
    eng = EmbeddedEngine(CFG, dtype=torch.float32)
    eng.load_weights(random_weights(CFG))
    return eng


@pytest.fixture
def server(request, tmp_path):
    """A served engine with weights; ``request.param``: keyword limits for ``serve``."""
    limits = dict(getattr(request, "param", {}))
    limits.setdefault("weights_root", str(tmp_path / "root"))
    srv, url = serve(_engine(), **limits)
    yield srv, url
    srv.shutdown()
    srv.server_close()


def _raw(url: str, data: bytes, *, timeout: float = 5.0) -> bytes:
    """Send raw bytes, return everything the server answers until it closes (or ``timeout``)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            out += chunk
            if b"\r\n\r\n" in out:
                head, _, body = out.partition(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                if length and len(body) >= length[0]:
                    break
        return out


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1."), answer[:200]
    return int(answer.split(b" ")[1])


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"{extra}\r\n").encode() + body


# ------------------------------------------------------------------ who may load weights
def test_weights_load_only_from_inside_the_weights_root(server, tmp_path):
    srv, url = server
    client = SGLangClient(url, timeout=10)
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    save_hf_checkpoint(str(root / "engine_weights"), random_weights(CFG, 1), CFG, EOS)
    save_hf_checkpoint(str(outside), random_weights(CFG, 2), CFG, EOS)
    version = client._call("GET", "/get_model_info")["weight_version"]
    with pytest.raises(SGLangHTTPError, match="HTTP 403.*outside the weights root"):
        client.update_weights_from_disk(str(outside))
    with pytest.raises(SGLangHTTPError, match="HTTP 403"):
        client.update_weights_from_disk(str(root / ".." / "elsewhere"))
    os.symlink(outside, root / "link")
    with pytest.raises(SGLangHTTPError, match="HTTP 403"):  # a symlink inside the root pointing out of it
        client.update_weights_from_disk(str(root / "link"))
    assert client._call("GET", "/get_model_info")["weight_version"] == version  # nothing was loaded
    assert client.update_weights_from_disk(str(root / "engine_weights"))["success"]


@pytest.mark.parametrize("linked", ["model.safetensors", "config.json"])
def test_a_file_inside_the_weights_root_linking_out_of_it_is_refused(server, tmp_path, linked):
    """The directory is inside the root, one of its files is a symlink to a file outside: refused (403, naming
    the file), nothing loaded; a link to a file inside the root is followed."""
    srv, url = server
    client = SGLangClient(url, timeout=10)
    root, outside = tmp_path / "root", tmp_path / "elsewhere"
    save_hf_checkpoint(str(outside), random_weights(CFG, 2), CFG, EOS)
    save_hf_checkpoint(str(root / "engine_weights"), random_weights(CFG, 1), CFG, EOS)
    (root / "engine_weights" / linked).unlink()
    (root / "engine_weights" / linked).symlink_to(outside / linked)
    version = client._call("GET", "/get_model_info")["weight_version"]
    with pytest.raises(SGLangHTTPError, match=rf"HTTP 403.*{linked} of model_path .* resolves to .*elsewhere/{linked}, "
                                              "outside the weights root"):
        client.update_weights_from_disk(str(root / "engine_weights"))
    assert client._call("GET", "/get_model_info")["weight_version"] == version  # nothing was loaded
    save_hf_checkpoint(str(root / "other"), random_weights(CFG, 3), CFG, EOS)
    (root / "engine_weights" / linked).unlink()
    (root / "engine_weights" / linked).symlink_to(root / "other" / linked)
    assert client.update_weights_from_disk(str(root / "engine_weights"))["success"]


def test_a_symlink_swapped_in_after_the_check_is_not_followed(tmp_path):
    """The engine opens the resolved paths it was given without following a link at the last component."""
    from examples.rl.model import WEIGHTS_FILE

    save_hf_checkpoint(str(tmp_path / "w"), random_weights(CFG), CFG, EOS)
    save_hf_checkpoint(str(tmp_path / "evil"), random_weights(CFG, 5), CFG, EOS)
    files = {"config.json": str(tmp_path / "w" / "config.json"), WEIGHTS_FILE: str(tmp_path / "w" / WEIGHTS_FILE)}
    eng = EmbeddedEngine(CFG, dtype=torch.float32)
    assert eng.update_weights_from_disk(str(tmp_path / "w"), files=files)["success"]
    (tmp_path / "w" / WEIGHTS_FILE).unlink()
    (tmp_path / "w" / WEIGHTS_FILE).symlink_to(tmp_path / "evil" / WEIGHTS_FILE)
    res = eng.update_weights_from_disk(str(tmp_path / "w"), files=files)
    assert not res["success"] and "(a symlink)" in res["message"]


def test_no_weights_root_means_no_weight_loading(tmp_path):
    save_hf_checkpoint(str(tmp_path / "w"), random_weights(CFG), CFG, EOS)
    srv, url = serve(_engine())
    try:
        with pytest.raises(SGLangHTTPError, match="HTTP 403.*without --weights-root"):
            SGLangClient(url, timeout=10).update_weights_from_disk(str(tmp_path / "w"))
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("server", [{"api_key": "s3cret"}], indirect=True)
def test_api_key_is_required_when_set(server):
    _, url = server
    with pytest.raises(SGLangHTTPError, match="HTTP 401"):
        SGLangClient(url, timeout=10).generate(REQ)
    with pytest.raises(SGLangHTTPError, match="HTTP 401"):
        SGLangClient(url, timeout=10, api_key="wrong").generate(REQ)
    assert SGLangClient(url, timeout=10, api_key="s3cret").generate(REQ)["meta_info"]["completion_tokens"] >= 1
    SGLangClient(url, timeout=10).wait_healthy(timeout=5)  # /health stays open (load balancers probe it)


# ------------------------------------------------------------------ request sizes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [{"max_body": 4096}], indirect=True)
def test_request_size_is_checked_before_reading(server):
    _, url = server
    huge = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000000000\r\n\r\n{}"
    assert _status(_raw(url, huge)) == 413
    assert _status(_raw(url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")) == 413
    for bad in (b"-1", b"abc", b"1e3", b"9" * 5000):
        answer = _raw(url, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: " + bad + b"\r\n\r\n{}")
        assert _status(answer) == 400, bad
    assert _status(_raw(url, b"POST /generate HTTP/1.1\r\nHost: x\r\n\r\n")) == 411
    assert _status(_raw(url, _post("/generate", json.dumps(REQ).encode()))) == 200  # still serving


# ------------------------------------------------------------------ malformed bodies
BAD_BODIES = {
    "JSON list": (b"[1, 2, 3]", "must be a JSON object"),
    "not JSON": (b"{nope", "bad JSON body"),
    "token id >= vocab": (json.dumps({**REQ, "input_ids": [1, 16, SEP]}).encode(), "input_ids[1] = 16"),
    "negative token id": (json.dumps({**REQ, "input_ids": [1, -3, SEP]}).encode(), "input_ids[1] = -3"),
    "float token id": (json.dumps({**REQ, "input_ids": [1, 2.5]}).encode(), "input_ids[1] = 2.5"),
    "batched bad id": (json.dumps({**REQ, "input_ids": [[1, 2], [3, 99]]}).encode(), "input_ids[1][1] = 99"),
    "prompt too long": (json.dumps({**REQ, "input_ids": [1] * 12}).encode(), "has 12 tokens"),
    "NaN temperature": (b'{"input_ids": [1, 2], "return_logprob": true, "sampling_params": {"temperature": NaN}}',
                        "temperature must be a finite number"),
    "string top_p": (json.dumps({**REQ, "sampling_params": {"top_p": "0.9"}}).encode(), "top_p must be a finite"),
    "list sampling_params": (json.dumps({**REQ, "sampling_params": [1]}).encode(), "sampling_params must be"),
    "bad stop ids": (json.dumps({**REQ, "sampling_params": {"stop_token_ids": [[1]]}}).encode(), "stop_token_ids"),
    "huge seed": (json.dumps({**REQ, "sampling_params": {"sampling_seed": 2**70}}).encode(), "sampling_seed"),
    "deep nesting": (b"[" * 100_000 + b"]" * 100_000, "bad JSON body"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_malformed_bodies_are_400_and_the_server_keeps_serving(server, case):
    _, url = server
    body, words = BAD_BODIES[case]
    answer = _raw(url, _post("/generate", body))
    assert _status(answer) == 400, answer[:300]
    assert words in answer.partition(b"\r\n\r\n")[2].decode(), answer[-300:]
    assert _status(_raw(url, _post("/update_weights_from_disk", body))) in (400, 403)
    assert SGLangClient(url, timeout=10).generate(REQ)["meta_info"]["completion_tokens"] >= 1


# ------------------------------------------------------------------ idle connections, threads, backlog
@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [{"socket_timeout": 0.5, "max_threads": 4}], indirect=True)
def test_idle_connections_time_out_and_threads_stay_bounded(server):
    _, url = server
    host, port = url.removeprefix("http://").split(":")
    before = threading.active_count()
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(60)]
    try:
        time.sleep(0.3)
        assert threading.active_count() <= before + 4  # 4 handler threads at most, the rest wait
        # every idle connection is dropped within about (60 / 4) socket timeouts: recv sees the close
        for s in idle:
            s.settimeout(15)
            assert s.recv(1) == b""
        answer = SGLangClient(url, timeout=10).generate(REQ)
        assert answer["meta_info"]["completion_tokens"] >= 1
    finally:
        for s in idle:
            s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("server", [{"socket_timeout": 3.0, "max_threads": 4}], indirect=True)
def test_health_is_answered_during_an_idle_flood(server):
    """200 connections that send nothing (3 s socket timeout, 4 handler threads): /health and a /generate are
    answered at once, not after the idle connections time out; the idle ones are closed after ~3 s."""
    _, url = server
    host, port = url.removeprefix("http://").split(":")
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(200)]
    try:
        time.sleep(0.2)  # the server has accepted them
        t0 = time.monotonic()
        assert SGLangClient(url, timeout=2.5)._call("GET", "/health") == {"status": "ok"}
        assert SGLangClient(url, timeout=2.5).generate(REQ)["meta_info"]["completion_tokens"] >= 1
        assert time.monotonic() - t0 < 2.0
        for s in idle[:5]:
            s.settimeout(10)
            assert s.recv(1) == b""  # closed by the server at its first-byte deadline
    finally:
        for s in idle:
            s.close()


@pytest.mark.timeout(120)
def test_fifty_concurrent_requests_are_all_served(server):
    srv, url = server
    assert srv.request_queue_size >= 50  # the listen backlog (socketserver's default is 5)

    def one(i: int) -> int:
        req = {**REQ, "sampling_params": {**REQ["sampling_params"], "sampling_seed": i}}
        return len(SGLangClient(url, timeout=60).generate(req)["output_ids"])

    with ThreadPoolExecutor(50) as pool:
        lengths = list(pool.map(one, range(50)))
    assert len(lengths) == 50 and all(n >= 1 for n in lengths)


# ------------------------------------------------------------------ the client against a hostile server
class _FakeServer:
    """A one-connection-at-a-time TCP server on 127.0.0.1 that answers with ``reply(conn)``."""

    def __init__(self, reply) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.reply, self.stop = reply, threading.Event()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    self.reply(conn, self.stop)
                except OSError:
                    pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def _answer(body: bytes, length: int | None = None):
    def reply(conn, stop):
        n = len(body) if length is None else length
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % n + body)
    return reply


def _trickle(conn, stop):
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
    while not stop.is_set():  # one byte every 0.1 s: each read is quick, the answer never ends
        conn.sendall(b" ")
        time.sleep(0.1)


def _call_bounded(client: SGLangClient, limit: float) -> tuple[BaseException | None, float]:
    """Run ``client.generate`` in a thread; the test never waits more than ``limit`` seconds."""
    out: list[BaseException | None] = [None]

    def run():
        try:
            client.generate(REQ)
        except BaseException as e:
            out[0] = e

    t0 = time.monotonic()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), f"the client was still waiting after {limit} s"
    return out[0], time.monotonic() - t0


@pytest.mark.timeout(60)
def test_client_invalid_json_is_its_own_error():
    from examples.rl.http_client import SGLangResponseError

    fake = _FakeServer(_answer(b"<html>not json</html>"))
    try:
        err, _ = _call_bounded(SGLangClient(fake.url, timeout=5), 10)
        assert isinstance(err, SGLangResponseError) and "not JSON" in str(err)
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_client_reads_are_bounded():
    from examples.rl.http_client import SGLangResponseError

    fake = _FakeServer(_answer(b"{}", length=1 << 40))  # announces a terabyte
    try:
        err, _ = _call_bounded(SGLangClient(fake.url, timeout=5, max_response_bytes=1 << 20), 10)
        assert isinstance(err, SGLangResponseError) and "announces 1099511627776 bytes" in str(err)
    finally:
        fake.close()
    fake = _FakeServer(_answer(b"[" + b"1," * 600_000 + b"1]"))  # 1.2 MB actually sent
    try:
        err, _ = _call_bounded(SGLangClient(fake.url, timeout=5, max_response_bytes=1 << 20), 10)
        assert isinstance(err, SGLangResponseError)
    finally:
        fake.close()


@pytest.mark.timeout(60)
def test_a_trickling_server_cannot_hold_the_client_past_its_deadline():
    fake = _FakeServer(_trickle)
    try:
        err, elapsed = _call_bounded(SGLangClient(fake.url, timeout=1.0), 10)
        assert isinstance(err, SGLangHTTPError) and "deadline" in str(err), err
        assert elapsed < 3.0 and not math.isnan(elapsed)
    finally:
        fake.close()
