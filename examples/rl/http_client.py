"""Minimal HTTP client for SGLang's native API (stdlib only): ``/generate`` and weight updates.

Used for ``--sglang-url``: the same client talks to a real SGLang server on a GPU cluster or to the
embedded engine served by :mod:`examples.rl.http_server`.

Every call is bounded: ``timeout`` is the deadline of the whole call (connect, send, headers and body), not
of each socket read, so a server that trickles its answer cannot hold the trainer past it; a body larger
than ``max_response_bytes`` (announced or received) is refused without reading it all; an answer that is
not JSON raises :class:`SGLangResponseError`. With ``api_key`` (the trainer passes ``$SGLANG_API_KEY``)
every request carries ``Authorization: Bearer KEY``, SGLang's ``--api-key`` scheme.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from typing import Any

DEFAULT_MAX_RESPONSE = 1 << 30
_READ_BLOCK = 1 << 16


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status, could not be reached, or did not answer in time."""


class SGLangResponseError(SGLangHTTPError):
    """The server answered 2xx but the body is not usable: not JSON, or larger than the limit."""


class SGLangClient:
    """``SGLangClient("http://127.0.0.1:30000")``; every call raises :class:`SGLangHTTPError` on failure."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 300.0,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE,
        api_key: str | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--sglang-url must start with http:// or https://, got {base_url!r}")
        parts = urllib.parse.urlsplit(base_url)
        if not parts.hostname:
            raise ValueError(f"--sglang-url has no host: {base_url!r}")
        if timeout <= 0 or max_response_bytes < 1:
            raise ValueError(f"timeout must be > 0 and max_response_bytes >= 1, got {timeout}, {max_response_bytes}")
        self.base_url, self.timeout = base_url.rstrip("/"), float(timeout)
        self.max_response_bytes, self.api_key = int(max_response_bytes), api_key
        self._parts = parts

    def _connection(self, timeout: float) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._parts.scheme == "https" else http.client.HTTPConnection
        return cls(self._parts.hostname, self._parts.port, timeout=timeout)

    def _call(self, method: str, path: str, payload: Any | None = None) -> Any:
        where = f"{method} {self.base_url}{path}"
        data = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        conn = self._connection(self.timeout)
        expired = threading.Event()

        def abort() -> None:  # the deadline: unblock whatever read or write is in progress
            expired.set()
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        timer = threading.Timer(self.timeout, abort)
        timer.daemon = True
        timer.start()
        try:
            conn.request(method, self._parts.path.rstrip("/") + path, body=data, headers=headers)
            resp = conn.getresponse()
            body = self._read(resp, where, expired)
        except SGLangHTTPError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as e:
            if expired.is_set():
                raise SGLangHTTPError(f"{where}: no complete answer within the {self.timeout:g} s deadline") from None
            raise SGLangHTTPError(f"{where} failed: {type(e).__name__}: {e}") from e
        finally:
            timer.cancel()
            conn.close()
        if resp.status >= 400:
            detail = body[:500].decode("utf-8", errors="replace")
            raise SGLangHTTPError(f"{where} -> HTTP {resp.status}: {detail}")
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:
            raise SGLangResponseError(
                f"{where} -> HTTP {resp.status} with a body that is not JSON ({str(e)[:120]}): {body[:120]!r}"
            ) from None

    def _read(self, resp: http.client.HTTPResponse, where: str, expired: threading.Event) -> bytes:
        """The response body, at most ``max_response_bytes`` (announced sizes checked before reading)."""
        limit = self.max_response_bytes
        announced = resp.getheader("Content-Length")
        if announced is not None and announced.strip().isdigit() and int(announced) > limit:
            raise SGLangResponseError(f"{where}: the answer announces {int(announced)} bytes, above the limit {limit}")
        chunks, size = [], 0
        while True:
            block = resp.read1(_READ_BLOCK) if hasattr(resp, "read1") else resp.read(_READ_BLOCK)
            if not block:
                break
            size += len(block)
            if size > limit:
                raise SGLangResponseError(f"{where}: the answer exceeds the limit of {limit} bytes")
            chunks.append(block)
        if expired.is_set():
            raise SGLangHTTPError(f"{where}: no complete answer within the {self.timeout:g} s deadline")
        return b"".join(chunks)

    def generate(self, request: dict[str, Any]) -> Any:
        """POST ``/generate`` and return the decoded JSON (a dict, or a list for batched input)."""
        return self._call("POST", "/generate", request)

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        """POST ``/update_weights_from_disk``; raises unless the server reports success."""
        res = self._call("POST", "/update_weights_from_disk", {"model_path": model_path})
        if not isinstance(res, dict) or not res.get("success", False):
            message = res.get("message") if isinstance(res, dict) else res
            raise SGLangHTTPError(f"weight update from {model_path!r} failed: {message}")
        return res

    def wait_healthy(self, timeout: float = 60.0) -> None:
        """Poll ``/health`` until it answers 200 (raises after ``timeout`` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._call("GET", "/health")
                return
            except SGLangHTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
