"""Serve the embedded engine over HTTP with SGLang's native endpoints (localhost only).

Endpoints (JSON bodies, the same shapes SGLang uses):

* ``POST /generate`` -> :meth:`EmbeddedEngine.generate` (503 until weights are loaded);
* ``POST /update_weights_from_disk`` ``{"model_path": DIR}`` -> ``{"success", "message"}``;
* ``GET /health`` -> 200; ``GET /get_model_info`` -> ``{"model_path", "weight_version", ...}``.

Run standalone::

    python -m examples.rl.http_server --port 30000 --weights-root RUN_DIR [--api-key KEY] [--dtype bfloat16]

The trainer then uses ``--run-dir RUN_DIR --sglang-url http://127.0.0.1:30000`` and pushes its weights through
``/update_weights_from_disk`` (from ``RUN_DIR/engine_weights``) before the first rollout.

Hardening (any local process can connect to a localhost port):

* weights load only from directories inside ``--weights-root``, and only files inside it (the directory and
  each file it reads resolved, symlinks followed; the files are then opened by their resolved paths, a
  symlink swapped in meanwhile refused; without ``--weights-root`` the endpoint refuses every path), and
  with ``--api-key`` (or ``SGLANG_API_KEY``) every endpoint but ``/health`` needs
  ``Authorization: Bearer KEY`` (SGLang's scheme; the trainer's client sends ``SGLANG_API_KEY``);
* a request body must announce its ``Content-Length``: missing -> 411, not a non-negative integer -> 400,
  above ``--max-body-mb`` -> 413, all answered before anything is read or allocated;
* every connection has a socket timeout (``--socket-timeout``: an idle or trickling client is dropped);
  a connection waits for its first bytes without a thread (:class:`EngineHTTPServer`: idle connections,
  up to :data:`MAX_WAITING` of them, the oldest closed beyond, never delay ``/health``), at most
  ``--max-threads`` connections are served at once, each connection serves one request (listen backlog
  :data:`LISTEN_BACKLOG`);
* a body that is not a JSON object, token ids outside ``[0, vocab)``, a prompt longer than the model,
  non-finite or mistyped sampling parameters -> 400 with the reason; an unexpected failure -> 500, and
  the server keeps serving.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hmac
import json
import os
import selectors
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from examples.rl.model import CHECKPOINT_FILES, ModelConfig
from examples.rl.quant import ENGINE_QUANT_CHOICES
from examples.rl.rollout_engine import EmbeddedEngine, EngineNotReadyError

LISTEN_BACKLOG = 256
#: connections waiting for their first bytes (no thread each); beyond, the oldest is closed
MAX_WAITING = 1024
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_SOCKET_TIMEOUT = 30.0
DEFAULT_MAX_THREADS = 32
LOCALHOST = ("127.0.0.1", "localhost", "::1")


class EngineHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server whose handler threads serve only connections that have sent something.

    An accepted connection first waits, without a thread, in a selector (at most :data:`MAX_WAITING`; when
    full the oldest is closed) until its first bytes arrive, then gets one of at most ``max_threads`` handler
    threads (the dispatcher waits for a free one) and is closed after one request. A connection that sends
    nothing within ``first_byte_timeout`` seconds is closed. So idle connections -- any number of them --
    cost a file descriptor each, never a thread, and ``/health`` is answered while they wait."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], *, max_threads: int,
                 first_byte_timeout: float = DEFAULT_SOCKET_TIMEOUT) -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self._slots = threading.BoundedSemaphore(max_threads)
        self.first_byte_timeout = float(first_byte_timeout)
        self._arrived: collections.deque[tuple[Any, Any]] = collections.deque()  # accepted, not yet parked
        self._parked: collections.OrderedDict[Any, tuple[float, Any]] = collections.OrderedDict()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._stop = threading.Event()
        super().__init__(address, handler)
        self._dispatcher = threading.Thread(target=self._dispatch, daemon=True, name="http-dispatch")
        self._dispatcher.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        """(accepting thread) Park the connection until it sends something."""
        self._arrived.append((request, client_address))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _dispatch(self) -> None:
        """(dispatcher thread) Hand readable connections to handler threads; close expired or surplus ones."""
        while not self._stop.is_set():
            while self._arrived:
                request, address = self._arrived.popleft()
                if len(self._parked) >= MAX_WAITING:
                    oldest, _ = self._parked.popitem(last=False)
                    self._drop(oldest)
                self._parked[request] = (time.monotonic() + self.first_byte_timeout, address)
                self._selector.register(request, selectors.EVENT_READ)
            now = time.monotonic()
            first = next(iter(self._parked.values()), None)
            wait = 0.5 if first is None else min(0.5, max(0.0, first[0] - now))
            for key, _ in self._selector.select(wait):
                if key.fileobj is self._wake_r:
                    with contextlib.suppress(OSError):
                        while self._wake_r.recv(4096):
                            pass
                    continue
                _, address = self._parked.pop(key.fileobj)
                self._selector.unregister(key.fileobj)
                self._start(key.fileobj, address)
            now = time.monotonic()
            while self._parked:  # deadlines rise in arrival order: expired ones are at the front
                request, (deadline, _) = next(iter(self._parked.items()))
                if deadline > now:
                    break
                del self._parked[request]
                self._drop(request)

    def _drop(self, request: Any) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(request)
        self.shutdown_request(request)

    def _start(self, request: Any, client_address: Any) -> None:
        while not self._slots.acquire(timeout=0.5):  # every handler busy with an active request
            if self._stop.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)  # a handler thread
        except BaseException:
            self._slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def server_close(self) -> None:
        self._stop.set()
        self._wake()
        self._dispatcher.join(timeout=5)
        for request in list(self._parked) + [r for r, _ in self._arrived]:
            self._drop(request)
        self._parked.clear()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        super().server_close()


class _BadRequest(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _inside(path: str, root: str) -> bool:
    real = os.path.realpath(path)
    return os.path.commonpath([real, root]) == root


def make_handler(
    engine: EmbeddedEngine,
    *,
    weights_root: str | None = None,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
) -> type[BaseHTTPRequestHandler]:
    """The request handler class (see the module docstring for the rules it enforces)."""
    state: dict[str, Any] = {"model_path": None}
    root = os.path.realpath(weights_root) if weights_root else None

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = socket_timeout  # StreamRequestHandler.setup: settimeout on the connection

        def log_message(self, fmt: str, *args: Any) -> None:  # keep the trainer's console clean
            pass

        def parse_request(self) -> bool:
            ok = super().parse_request()
            self.close_connection = True  # one request per connection: no idle keep-alive holds a thread
            return ok

        def _reply(self, code: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _authorised(self) -> bool:
            if api_key is None or self.path == "/health":
                return True
            given = self.headers.get("Authorization", "")
            return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

        def _body(self) -> dict[str, Any]:
            """The JSON object of the request body; sizes checked before reading."""
            if self.headers.get("Transfer-Encoding"):
                raise _BadRequest(411, "chunked bodies are not accepted: send Content-Length")
            raw = self.headers.get("Content-Length")
            if raw is None:
                raise _BadRequest(411, "a POST needs a Content-Length header")
            if not raw.strip().isdigit() or len(raw) > 20:
                raise _BadRequest(400, f"Content-Length must be a non-negative integer, got {raw[:40]!r}")
            length = int(raw)
            if length > max_body:
                raise _BadRequest(413, f"request body of {length} bytes exceeds the limit of {max_body}")
            data = self.rfile.read(length)
            if len(data) != length:
                raise _BadRequest(400, f"the body ended after {len(data)} of {length} bytes")
            try:
                req = json.loads(data or b"{}")
            except (ValueError, RecursionError) as e:
                raise _BadRequest(400, f"bad JSON body: {str(e)[:200]}") from None
            if not isinstance(req, dict):
                raise _BadRequest(400, f"the body must be a JSON object, got {type(req).__name__}")
            return req

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if not self._authorised():
                self._reply(401, {"error": "missing or wrong 'Authorization: Bearer <api key>'"})
            elif self.path == "/health":
                self._reply(200, {"status": "ok"})
            elif self.path == "/get_model_info":
                self._reply(
                    200,
                    {
                        "model_path": state["model_path"],
                        "weight_version": engine.weight_version,
                        "is_generation": True,
                        "engine": "slime_tis embedded",
                    },
                )
            else:
                self._reply(404, {"error": f"unknown path {self.path[:200]}"})

        def do_POST(self) -> None:  # noqa: N802
            try:
                if not self._authorised():
                    raise _BadRequest(401, "missing or wrong 'Authorization: Bearer <api key>'")
                req = self._body()
                if self.path == "/generate":
                    self._reply(200, engine.generate(req))
                elif self.path == "/update_weights_from_disk":
                    self._reply(*self._update_weights(req))
                else:
                    raise _BadRequest(404, f"unknown path {self.path[:200]}")
            except _BadRequest as e:
                self.close_connection = True  # an unread or rejected body must not be parsed as the next request
                self._reply(e.code, {"error": str(e), "success": False, "message": str(e)})
            except EngineNotReadyError as e:
                self._reply(503, {"error": str(e)})
            except ValueError as e:
                self._reply(400, {"error": str(e)})
            except TimeoutError:
                self.close_connection = True  # the client stopped sending: drop it
            except Exception as e:  # noqa: BLE001 - one bad request must not take the server down
                self.close_connection = True
                self._reply(500, {"error": f"internal error: {type(e).__name__}: {str(e)[:200]}"})

        def _update_weights(self, req: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            path = req.get("model_path")
            if not isinstance(path, str) or not path:
                return 400, {"success": False, "message": f"model_path must be a non-empty string, got {path!r}"}
            if root is None:
                return 403, {"success": False, "message": "this server was started without --weights-root: it "
                             "loads no weights over HTTP"}
            if not _inside(path, root):
                return 403, {"success": False, "message": f"model_path {path!r} is outside the weights root "
                             f"{root} (symlinks resolved)"}
            real = os.path.realpath(path)
            files = {name: os.path.realpath(os.path.join(real, name)) for name in CHECKPOINT_FILES}
            for name, file in files.items():  # every file, not only the directory: a link may point out
                if not _inside(file, root):
                    return 403, {"success": False, "message": f"{name} of model_path {path!r} resolves to {file}, "
                                 f"outside the weights root {root} (symlinks resolved)"}
            res = engine.update_weights_from_disk(real, files=files)
            if res["success"]:
                state["model_path"] = path
            return (200 if res["success"] else 400), res

    return Handler


def make_server(
    engine: EmbeddedEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    weights_root: str | None = None,
    api_key: str | None = None,
    max_body: int = DEFAULT_MAX_BODY,
    socket_timeout: float = DEFAULT_SOCKET_TIMEOUT,
    max_threads: int = DEFAULT_MAX_THREADS,
) -> EngineHTTPServer:
    """The server (not started): localhost only, with the limits of the module docstring."""
    if host not in LOCALHOST:
        raise ValueError(f"the embedded server binds to localhost only, got host={host!r}")
    if socket_timeout <= 0 or max_body < 0:
        raise ValueError(f"socket_timeout must be > 0 and max_body >= 0, got {socket_timeout}, {max_body}")
    handler = make_handler(
        engine, weights_root=weights_root, api_key=api_key, max_body=max_body, socket_timeout=socket_timeout
    )
    return EngineHTTPServer((host, port), handler, max_threads=max_threads, first_byte_timeout=socket_timeout)


def serve(
    engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0, **limits: Any
) -> tuple[ThreadingHTTPServer, str]:
    """Start serving ``engine`` in a daemon thread; returns the server and its base URL. ``limits``: the
    keyword arguments of :func:`make_server` (``weights_root``, ``api_key``, ...).
    Stop with ``server.shutdown(); server.server_close()``."""
    server = make_server(engine, host, port, **limits)
    threading.Thread(target=server.serve_forever, daemon=True, name="embedded-sglang").start()
    return server, f"http://{host}:{server.server_address[1]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", default=None, help="initial checkpoint directory (optional)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--logit-noise", type=float, default=0.0)
    p.add_argument("--quant", choices=ENGINE_QUANT_CHOICES, default="none", help="weight-only quantized linears")
    p.add_argument("--lm-head-fp32", action="store_true", help="LM head and logits in float32")
    p.add_argument("--num-layers", type=int, default=ModelConfig.num_layers)
    p.add_argument("--hidden-size", type=int, default=ModelConfig.hidden_size)
    p.add_argument("--num-heads", type=int, default=ModelConfig.num_heads)
    p.add_argument(
        "--max-seq-len",
        type=int,
        default=ModelConfig.max_seq_len,
        help="positions (the trainer uses max(16, 2 * num_digits + 2))",
    )
    p.add_argument("--moe-experts", type=int, default=0, help="mixture of experts (as the trainer's --moe-experts)")
    p.add_argument("--moe-topk", type=int, default=2, help="experts per token (with --moe-experts)")
    p.add_argument(
        "--weights-root",
        default=None,
        help="/update_weights_from_disk loads only directories inside this one (the trainer's RUN_DIR); "
        "without it no weights are loaded over HTTP",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("SGLANG_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: $SGLANG_API_KEY)",
    )
    p.add_argument("--max-body-mb", type=float, default=DEFAULT_MAX_BODY / (1 << 20), help="request size limit")
    p.add_argument("--socket-timeout", type=float, default=DEFAULT_SOCKET_TIMEOUT, help="seconds per socket read")
    p.add_argument("--max-threads", type=int, default=DEFAULT_MAX_THREADS, help="connections served at once")
    args = p.parse_args(argv)
    cfg = ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_heads=args.num_heads,
        max_seq_len=args.max_seq_len,
        moe_experts=args.moe_experts,
        moe_topk=args.moe_topk if args.moe_experts else 0,
    )
    engine = EmbeddedEngine(
        cfg,
        dtype=getattr(torch, args.dtype),
        logit_noise=args.logit_noise,
        quant=args.quant,
        lm_head_fp32=args.lm_head_fp32,
    )
    if args.model_path:
        res = engine.update_weights_from_disk(args.model_path)
        if not res["success"]:
            raise SystemExit(res["message"])
    server = make_server(
        engine,
        "127.0.0.1",
        args.port,
        weights_root=args.weights_root,
        api_key=args.api_key or None,
        max_body=int(args.max_body_mb * (1 << 20)),
        socket_timeout=args.socket_timeout,
        max_threads=args.max_threads,
    )
    print(f"embedded SGLang-protocol server on http://127.0.0.1:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
