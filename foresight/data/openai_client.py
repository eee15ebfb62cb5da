"""A small client for an OpenAI-compatible inference server (vLLM, SGLang, ``transformers serve``): the served models
and a completion request, retried with exponential backoff on transient failures (connection refused or reset,
timeouts, HTTP 408/429/5xx). Every failure it gives up on is a :class:`ServerError` that names the URL.

Standard library only (``urllib``), so that the data stage needs nothing beyond the project's dependencies."""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.error
import urllib.request

TRANSIENT_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class ServerError(RuntimeError):
    """The server could not be reached, refused a request, or answered something unusable."""


class RejectedRequest(ServerError):
    """The server answered 4xx (not transient): the request itself is wrong for this server."""

    def __init__(self, message: str, status: int, body: str):
        super().__init__(message)
        self.status, self.body = status, body


class ServerClient:
    """``base_url`` is the API root, e.g. ``http://localhost:8000/v1`` (a URL without ``/v1`` gets it appended)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0, max_retries: int = 5,
                 backoff: float = 0.5, sleep=time.sleep):
        url = base_url.rstrip("/")
        self.base_url = url if url.endswith("/v1") else url + "/v1"
        self.api_key, self.timeout, self.max_retries, self.backoff, self.sleep = api_key, timeout, max_retries, backoff, sleep

    def model_entries(self) -> list[dict] | None:
        """``GET /models``'s entries (vLLM's carry ``root``, the folder it loaded), or None without that endpoint."""
        try:
            data = self._call("GET", "/models")
        except RejectedRequest as e:
            if e.status == 404:
                return None
            raise
        return [m for m in data.get("data", []) if isinstance(m, dict)]

    def complete(self, body: dict) -> dict:
        """``POST /completions`` with ``body``; -> the response's JSON."""
        return self._call("POST", "/completions", body)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        url = self.base_url + path
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = None if body is None else json.dumps(body).encode()
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                self.sleep(min(30.0, self.backoff * 2 ** (attempt - 1)) * (1 + 0.1 * random.random()))
            req = urllib.request.Request(url, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                text = e.read().decode(errors="replace")[:500]
                if e.code in TRANSIENT_STATUS:
                    last = f"HTTP {e.code}: {text}"
                    continue
                raise RejectedRequest(f"{method} {url} failed with HTTP {e.code}: {text}", e.code, text) from None
            except (urllib.error.URLError, ConnectionError, socket.timeout, TimeoutError) as e:
                last = str(getattr(e, "reason", e))
                continue
            try:
                return json.loads(raw)
            except ValueError:
                raise ServerError(f"{method} {url} answered something that is not JSON: {raw[:200]!r}") from None
        raise ServerError(f"the server at {self.base_url} did not answer {method} {path} after {self.max_retries + 1} "
                          f"attempts (last error: {last}); is it running and reachable?")
