"""Serve the embedded engine over HTTP with SGLang's native endpoints (localhost only).

Endpoints (JSON bodies, the same shapes SGLang uses):

* ``POST /generate`` -> :meth:`EmbeddedEngine.generate` (503 until weights are loaded);
* ``POST /update_weights_from_disk`` ``{"model_path": DIR}`` -> ``{"success", "message"}``;
* ``GET /health`` -> 200; ``GET /get_model_info`` -> ``{"model_path", "weight_version", ...}``.

Run standalone::

    python -m examples.rl.http_server --port 30000 [--model-path DIR] [--dtype bfloat16] [--logit-noise 0]

The trainer then uses ``--sglang-url http://127.0.0.1:30000`` and pushes its weights through
``/update_weights_from_disk`` before the first rollout.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from examples.rl.model import ModelConfig
from examples.rl.quant import ENGINE_QUANT_CHOICES
from examples.rl.rollout_engine import EmbeddedEngine, EngineNotReadyError


def make_handler(engine: EmbeddedEngine) -> type[BaseHTTPRequestHandler]:
    state: dict[str, Any] = {"model_path": None}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:  # keep the trainer's console clean
            pass

        def _reply(self, code: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server naming)
            if self.path == "/health":
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
                self._reply(404, {"error": f"unknown path {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            try:
                length = int(self.headers.get("Content-Length", "0"))
                req = json.loads(self.rfile.read(length) or b"{}")
            except (ValueError, json.JSONDecodeError) as e:
                self._reply(400, {"error": f"bad JSON body: {e}"})
                return
            if self.path == "/generate":
                try:
                    self._reply(200, engine.generate(req))
                except EngineNotReadyError as e:
                    self._reply(503, {"error": str(e)})
                except ValueError as e:
                    self._reply(400, {"error": str(e)})
            elif self.path == "/update_weights_from_disk":
                path = req.get("model_path")
                if not isinstance(path, str):
                    self._reply(400, {"success": False, "message": f"model_path must be a string, got {path!r}"})
                    return
                res = engine.update_weights_from_disk(path)
                if res["success"]:
                    state["model_path"] = path
                self._reply(200 if res["success"] else 400, res)
            else:
                self._reply(404, {"error": f"unknown path {self.path}"})

    return Handler


def serve(engine: EmbeddedEngine, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start serving ``engine`` in a daemon thread; returns the server and its base URL.
    Stop with ``server.shutdown(); server.server_close()``."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the embedded server binds to localhost only, got host={host!r}")
    server = ThreadingHTTPServer((host, port), make_handler(engine))
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
    args = p.parse_args(argv)
    cfg = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_heads=args.num_heads, max_seq_len=args.max_seq_len
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
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(engine))
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
