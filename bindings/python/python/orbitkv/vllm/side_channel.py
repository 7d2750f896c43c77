"""The P/D HTTP control channel between a decode rank and the prefill ranks.

Each prefill worker rank listens on ``side_channel_port + tp_rank``. A decode
rank POSTs its handshake (OrbitKV's versioned JSON) to
``/orbitkv/v1/handshake`` of every producer rank that holds its heads. The
listener admits it into the local runtime: a bad handshake is answered
``400`` with the typed error, and nothing is admitted. Imports nothing from
vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

logger = logging.getLogger("orbitkv.side_channel")

HANDSHAKE_PATH = "/orbitkv/v1/handshake"
CANCEL_PATH = "/orbitkv/v1/cancel"
HEALTH_PATH = "/orbitkv/v1/health"
MAX_BODY = 16 << 20


class HandshakeRejected(RuntimeError):
    """The producer refused the handshake (its reply names the error)."""


class SideChannelServer:
    """Receives handshakes for ``admit`` (which raises on a bad one) and
    cancellations (``{"version": 1, "request_id": ...}``) for ``cancel``."""

    def __init__(
        self,
        host: str,
        port: int,
        admit: Callable[[str], None],
        cancel: Callable[[str, str], None] | None = None,
    ):
        admit_fn = admit
        cancel_fn = cancel

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt: str, *args: object) -> None:  # noqa: D102
                logger.debug("side channel: " + fmt, *args)

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == HEALTH_PATH:
                    self._reply(200, {"ok": True})
                else:
                    self._reply(404, {"error": "NotFound", "message": self.path})

            def do_POST(self) -> None:  # noqa: N802
                if self.path not in (HANDSHAKE_PATH, CANCEL_PATH):
                    self._reply(404, {"error": "NotFound", "message": self.path})
                    return
                try:
                    n = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    n = -1
                if n < 0 or n > MAX_BODY:
                    self._reply(413, {"error": "BadLength", "message": f"Content-Length {n}"})
                    return
                body = self.rfile.read(n).decode("utf-8", errors="replace")
                if self.path == CANCEL_PATH:
                    try:
                        msg = json.loads(body)
                        if msg.get("version") != 1 or not isinstance(msg.get("request_id"), str) or not msg["request_id"]:
                            raise ValueError("expected {\"version\": 1, \"request_id\": STR, \"reason\": STR}")
                    except ValueError as e:
                        self._reply(400, {"error": "Malformed", "message": str(e)})
                        return
                    if cancel_fn is not None:
                        cancel_fn(msg["request_id"], str(msg.get("reason", "")))
                    self._reply(200, {"ok": True})
                    return
                try:
                    admit_fn(body)
                except Exception as e:  # the runtime's typed errors
                    logger.warning("handshake refused: %s: %s", type(e).__name__, e)
                    self._reply(400, {"error": type(e).__name__, "message": str(e)})
                    return
                self._reply(200, {"ok": True})

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="orbitkv-side-channel", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def post_handshake(address: str, handshake_json: str, timeout_s: float = 5.0) -> None:
    """POSTs a handshake to a producer rank's side channel. Raises
    :class:`HandshakeRejected` when it answers with an error, ``OSError``
    when it cannot be reached."""
    req = urllib.request.Request(
        f"http://{address}{HANDSHAKE_PATH}",
        data=handshake_json.encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read() or b"{}")
        except ValueError:
            detail = {}
        raise HandshakeRejected(
            f"{address} refused the handshake: {detail.get('error', e.code)}: {detail.get('message', '')}"
        ) from None


def post_cancel(address: str, request_id: str, reason: str, timeout_s: float = 5.0) -> None:
    """Tells a producer rank that the consumer gave ``request_id`` up before
    authorizing anything, so it need not hold its source blocks until the
    handshake deadline. Raises ``OSError`` when the rank cannot be reached."""
    body = json.dumps({"version": 1, "request_id": request_id, "reason": reason}).encode()
    req = urllib.request.Request(
        f"http://{address}{CANCEL_PATH}", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        raise HandshakeRejected(f"{address} refused the cancellation: HTTP {e.code}") from None
