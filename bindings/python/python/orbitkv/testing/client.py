"""The client side of a test cluster, standard library only (``http.client``),
so a client can drop a connection at a moment of its choosing (aborts):
plain GET/POST, Prometheus metrics summed over labels, greedy completions
(streamed or not) and fresh prompts. Used by ``orbitkv.testing.cluster`` and
the end-to-end tests."""

from __future__ import annotations

import contextlib
import http.client
import json
import random
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from orbitkv.testing.processes import ClusterError

SERVED_MODEL = "tiny"


def prompt_source(seed: int) -> Callable[[int], list[int]]:
    """A source of fresh prompts: each call returns ``n`` token ids from a
    new seed (``seed``, ``seed + 1``, ...), so no two prompts share a prefix
    (no prefix-cache hit flatters a result). Give each test module its own
    ``seed`` range."""
    seeds = iter(range(seed, seed + 10**6))

    def fresh_prompt(n: int) -> list[int]:
        rng = random.Random(next(seeds))
        return [rng.randrange(3, 1024) for _ in range(n)]

    return fresh_prompt


def _split(url: str) -> tuple[str, int]:
    assert url.startswith("http://"), url
    host, port = url[len("http://") :].rstrip("/").rsplit(":", 1)
    return host, int(port)


def http_get(url: str, path: str, timeout_s: float = 5.0) -> tuple[int, bytes]:
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def http_post_json(
    url: str, path: str, body: dict[str, Any], timeout_s: float = 120.0
) -> tuple[int, Any, dict[str, str]]:
    """POST JSON, read the whole answer: (status, parsed JSON or text, headers)."""
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        headers = {k.lower(): v for k, v in r.getheaders()}
        try:
            return r.status, json.loads(data), headers
        except ValueError:
            return r.status, data.decode(errors="replace"), headers
    finally:
        conn.close()


def healthy(url: str) -> bool:
    status, _ = http_get(url, "/health", timeout_s=2.0)
    return status == 200


def metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """A server's Prometheus metrics, each name summed over its label sets
    (``_created`` series left out); a histogram's buckets also under
    ``name{le="bound"}``, summed over the other labels (for quantiles)."""
    status, body = http_get(url, "/metrics", timeout_s)
    if status != 200:
        raise ClusterError(f"{url}/metrics answered {status}")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_created"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + v
        if name.endswith("_bucket"):
            le = re.search(r'le="([^"]*)"', name_labels)
            if le:
                key = f'{name}{{le="{le.group(1)}"}}'
                out[key] = out.get(key, 0.0) + v
    return out


@dataclass
class Completion:
    """One completion: what came back and when."""

    status: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    ttft_s: float | None = None  # request sent -> first token (streaming only)
    # request sent -> each streamed chunk that carried tokens (streaming only)
    token_times: list[float] = field(default_factory=list)
    total_s: float = 0.0
    request_id: str | None = None  # the proxy's P/D request id (X-Request-Id)
    error: Any = None
    body: Any = None
    finish_reason: str | None = None  # the choice's, as vLLM sent it ("length", "error", ...)

    def failed(self, max_tokens: int) -> bool:
        """Whether the request did not produce its ``max_tokens`` (with
        ``ignore_eos``): an error status, ``finish_reason: error``, or a
        stream that ended early. vLLM 0.26 ends the stream of a request
        whose KV failed to load with a bare ``data: [DONE]`` (status 200)."""
        return self.status != 200 or self.finish_reason == "error" or len(self.token_ids) < max_tokens


def completion_body(
    prompt: str | list[int], max_tokens: int, stream: bool = False, **extra: Any
) -> dict[str, Any]:
    """A greedy ``/v1/completions`` request that returns the token ids."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": stream,
    }
    body.update(extra)
    return body


def complete(
    url: str,
    prompt: str | list[int],
    max_tokens: int = 16,
    stream: bool = False,
    timeout_s: float = 120.0,
    **extra: Any,
) -> Completion:
    """Sends one greedy completion to ``url`` (a vLLM server or the proxy).
    Streaming requests measure the time to the first token."""
    body = completion_body(prompt, max_tokens, stream, **extra)
    host, port = _split(url)
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    t0 = time.monotonic()
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        rid = r.getheader("X-Request-Id")
        if r.status != 200:
            raw = r.read()
            try:
                err: Any = json.loads(raw)
            except ValueError:
                err = raw.decode(errors="replace")
            return Completion(r.status, total_s=time.monotonic() - t0, request_id=rid, error=err)
        if not stream:
            data = json.loads(r.read())
            ch = data["choices"][0]
            return Completion(
                200,
                text=ch.get("text", ""),
                token_ids=list(ch.get("token_ids") or []),
                total_s=time.monotonic() - t0,
                request_id=rid,
                body=data,
                finish_reason=ch.get("finish_reason"),
            )
        out = Completion(200, request_id=rid)
        pieces: list[str] = []
        for event in _sse_events(r):
            if event == "[DONE]":
                break
            data = json.loads(event)
            if "error" in data:
                out.status = int(data["error"].get("code") or 500)
                out.error = data["error"]
                break
            for ch in data.get("choices", ()):
                ids = ch.get("token_ids") or []
                if ids or ch.get("text"):
                    out.token_times.append(time.monotonic() - t0)
                    if out.ttft_s is None:
                        out.ttft_s = out.token_times[0]
                pieces.append(ch.get("text") or "")
                out.token_ids.extend(ids)
                out.finish_reason = ch.get("finish_reason") or out.finish_reason
        out.text = "".join(pieces)
        out.total_s = time.monotonic() - t0
        return out
    finally:
        conn.close()


def _sse_events(r: http.client.HTTPResponse) -> Iterator[str]:
    while True:
        line = r.readline()
        if not line:
            return
        line = line.strip()
        if line.startswith(b"data:"):
            yield line[5:].strip().decode()


class Abandoned:
    """A completion request whose client walks away: :meth:`drop` closes the
    connection (vLLM, or the proxy, then aborts the request)."""

    def __init__(self, url: str, prompt: str | list[int], max_tokens: int = 16, stream: bool = True, **extra: Any):
        host, port = _split(url)
        self.sock = socket.create_connection((host, port), timeout=30)
        body = json.dumps(completion_body(prompt, max_tokens, stream, **extra)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        self.sock.sendall(head + body)
        self.sent = time.monotonic()

    def drop(self) -> None:
        # RST rather than FIN: the server sees the disconnect at once.
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        with contextlib.suppress(OSError):
            self.sock.close()
