"""Minimal HTTP client for SGLang's native API (stdlib only): ``/generate`` and weight updates.

Used for ``--sglang-url``: the same client talks to a real SGLang server on a GPU cluster or to the
embedded engine served by :mod:`examples.rl.http_server`.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any


class SGLangHTTPError(RuntimeError):
    """The server answered with an error status or could not be reached."""


class SGLangClient:
    """``SGLangClient("http://127.0.0.1:30000")``; every call raises :class:`SGLangHTTPError` on failure."""

    def __init__(self, base_url: str, *, timeout: float = 300.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"--sglang-url must start with http:// or https://, got {base_url!r}")
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def _call(self, method: str, path: str, payload: Any | None = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        req = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:500]
            raise SGLangHTTPError(f"{method} {self.base_url}{path} -> HTTP {e.code}: {detail}") from e
        except (urllib.error.URLError, OSError) as e:
            raise SGLangHTTPError(f"{method} {self.base_url}{path} failed: {e}") from e

    def generate(self, request: dict[str, Any]) -> Any:
        """POST ``/generate`` and return the decoded JSON (a dict, or a list for batched input)."""
        return self._call("POST", "/generate", request)

    def update_weights_from_disk(self, model_path: str) -> dict[str, Any]:
        """POST ``/update_weights_from_disk``; raises unless the server reports success."""
        res = self._call("POST", "/update_weights_from_disk", {"model_path": model_path})
        if not res.get("success", False):
            raise SGLangHTTPError(f"weight update from {model_path!r} failed: {res.get('message')}")
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
