"""The P/D HTTP control channel between a decode rank and the prefill ranks.

Each prefill worker rank listens on ``side_channel_port + tp_rank``. A decode
rank POSTs its handshake (OrbitKV's versioned JSON, parsed and checked by the
Rust core) to ``/orbitkv/v1/handshake`` of every producer rank that holds its
heads, and a cancel (``orbitkv.cancel_message``) to ``/orbitkv/v1/cancel``.

Both carry the request's capability, which the runtime checks: a sender
without it gets ``403`` and changes nothing. With a deployment key
(``orbitkv.pd.side_channel_key_file`` or ``ORBITKV_SIDE_CHANNEL_KEY``) every
POST must also carry ``X-OrbitKV-Signature: sha256=<hex HMAC-SHA256(key,
body)>``; one without a valid signature gets ``401`` before its body is
parsed. Replies: ``200`` admitted, ``400`` malformed (typed error in the
body), ``401`` bad signature, ``403`` wrong capability, ``404`` unknown path,
``408`` body not received in time, ``413`` body too large, ``503`` too many
handshakes waiting or too many connections. Imports nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

logger = logging.getLogger("orbitkv.side_channel")

HANDSHAKE_PATH = "/orbitkv/v1/handshake"
CANCEL_PATH = "/orbitkv/v1/cancel"
HEALTH_PATH = "/orbitkv/v1/health"
SIGNATURE_HEADER = "X-OrbitKV-Signature"
MAX_BODY = 16 << 20
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64

# Typed runtime errors -> HTTP status (anything else typed: 400).
_STATUS = {"ForbiddenError": 403, "OverloadedError": 503}


class HandshakeRejected(RuntimeError):
    """The producer refused the handshake or cancel (``status``: its HTTP
    status; its reply names the error)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def sign(key: bytes, body: bytes) -> str:
    """The signature header value for ``body`` under the deployment key."""
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


class SideChannelServer:
    """Receives handshakes for ``admit`` and cancels for ``cancel`` (both
    take the JSON body and raise the runtime's typed errors on refusal).
    Bounded: at most ``max_connections`` connections at once (more are
    answered 503 and closed), ``read_timeout_s`` per connection read, bodies
    up to ``MAX_BODY``."""

    def __init__(
        self,
        host: str,
        port: int,
        admit: Callable[[str], None],
        cancel: Callable[[str], None],
        *,
        key: bytes | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
    ):
        handlers = {HANDSHAKE_PATH: admit, CANCEL_PATH: cancel}
        slots = threading.BoundedSemaphore(max_connections)
        self.refused = {"signature": 0, "forbidden": 0, "malformed": 0, "busy": 0}
        refused = self.refused

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = read_timeout_s  # socket timeout for every read

            def log_message(self, fmt: str, *args: object) -> None:  # noqa: D102
                logger.debug("side channel: " + fmt, *args)

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if code >= 400:
                    self.send_header("Connection", "close")
                    self.close_connection = True
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                if self.path == HEALTH_PATH:
                    self._reply(200, {"ok": True})
                else:
                    self._reply(404, {"error": "NotFound", "message": self.path})

            def do_POST(self) -> None:  # noqa: N802
                fn = handlers.get(self.path)
                if fn is None:
                    self._reply(404, {"error": "NotFound", "message": self.path})
                    return
                try:
                    n = int(self.headers.get("Content-Length", "-1"))
                except ValueError:
                    n = -1
                if n < 0 or n > MAX_BODY:
                    self._reply(413, {"error": "BadLength", "message": f"Content-Length {n} (at most {MAX_BODY})"})
                    return
                try:
                    raw = self.rfile.read(n)
                except (TimeoutError, socket.timeout):
                    self._reply(408, {"error": "Timeout", "message": f"body not received in {read_timeout_s}s"})
                    return
                if len(raw) != n:
                    self.close_connection = True
                    return
                if key is not None:
                    got = self.headers.get(SIGNATURE_HEADER, "")
                    if not hmac.compare_digest(got.encode(), sign(key, raw).encode()):
                        refused["signature"] += 1
                        self._reply(401, {"error": "BadSignature", "message": f"missing or wrong {SIGNATURE_HEADER}"})
                        return
                try:
                    fn(raw.decode("utf-8", errors="replace"))
                except Exception as e:  # the runtime's typed errors
                    name = type(e).__name__
                    code = _STATUS.get(name, 400)
                    refused["forbidden" if code == 403 else "busy" if code == 503 else "malformed"] += 1
                    logger.warning("side channel %s refused: %s: %s", self.path, name, e)
                    self._reply(code, {"error": name, "message": str(e)})
                    return
                self._reply(200, {"ok": True})

        class Server(ThreadingHTTPServer):
            daemon_threads = True
            request_queue_size = 128

            def process_request(self, request, client_address):  # type: ignore[no-untyped-def]
                if not slots.acquire(blocking=False):
                    refused["busy"] += 1
                    try:
                        request.sendall(
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                    except OSError:
                        pass
                    self.shutdown_request(request)
                    return
                super().process_request(request, client_address)

            def handle_error(self, request, client_address):  # type: ignore[no-untyped-def]
                # A client that went away mid-reply: not the server's problem.
                logger.debug("side channel: connection from %s broke off", client_address, exc_info=True)

            def process_request_thread(self, request, client_address):  # type: ignore[no-untyped-def]
                try:
                    super().process_request_thread(request, client_address)
                finally:
                    slots.release()

        self._server = Server((host, port), Handler)
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


def _post(address: str, path: str, body: bytes, timeout_s: float, key: bytes | None, what: str) -> None:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers[SIGNATURE_HEADER] = sign(key, body)
    req = urllib.request.Request(f"http://{address}{path}", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            resp.read()
    except urllib.error.HTTPError as e:
        try:
            detail = json.loads(e.read() or b"{}")
        except ValueError:
            detail = {}
        raise HandshakeRejected(
            f"{address} refused the {what}: {detail.get('error', e.code)}: {detail.get('message', '')}", e.code
        ) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, OSError):
            raise e.reason from None  # ConnectionRefusedError: nothing was delivered
        raise


def post_handshake(address: str, handshake_json: str, timeout_s: float = 5.0, key: bytes | None = None) -> None:
    """POSTs a handshake to a producer rank's side channel. Raises
    :class:`HandshakeRejected` when it answers with an error, ``OSError``
    (``ConnectionRefusedError`` when nothing listens there) when it cannot
    be reached."""
    _post(address, HANDSHAKE_PATH, handshake_json.encode(), timeout_s, key, "handshake")


def post_cancel(address: str, cancel_json: str, timeout_s: float = 5.0, key: bytes | None = None) -> None:
    """Tells a producer rank that the consumer gave a request up before
    authorizing anything (``cancel_json`` from ``orbitkv.cancel_message``),
    so it need not hold its source blocks until the handshake deadline.
    Raises :class:`HandshakeRejected` or ``OSError`` as :func:`post_handshake`."""
    _post(address, CANCEL_PATH, cancel_json.encode(), timeout_s, key, "cancellation")
