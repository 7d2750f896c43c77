"""The P/D HTTP control channel between a decode rank and the prefill ranks:
the client half.

Each prefill worker rank serves ``side_channel_port + tp_rank`` with
:class:`orbitkv.SideChannel` (Rust, actix-web: bodies read, checked and
parsed without Python). A decode rank POSTs its handshake (OrbitKV's
versioned JSON) to ``/orbitkv/v1/handshake`` of every producer rank that
holds its heads, and a cancel (``orbitkv.cancel_message``) to
``/orbitkv/v1/cancel``, with the functions here.

Both carry the request's capability, which the runtime checks: a sender
without it gets ``403`` and changes nothing. With a deployment key
(``orbitkv.pd.side_channel_key_file`` or ``ORBITKV_SIDE_CHANNEL_KEY``) every
POST must also carry ``X-OrbitKV-Signature: sha256=<hex HMAC-SHA256(key,
body)>`` (:func:`sign`); one without a valid signature gets ``401`` before its
body is parsed. Replies: ``200`` admitted, ``400`` malformed (typed error in
the body), ``401`` bad signature, ``403`` wrong capability, ``404`` unknown
path, ``408`` body not received in time, ``413`` body too large, ``503`` too
many handshakes waiting or too many connections. Imports nothing from vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import urllib.error
import urllib.request

from orbitkv.errors import HandshakeRejected

__all__ = [
    "CANCEL_PATH",
    "HANDSHAKE_PATH",
    "HEALTH_PATH",
    "MAX_BODY",
    "MAX_CONNECTIONS",
    "READ_TIMEOUT_S",
    "SIGNATURE_HEADER",
    "HandshakeRejected",
    "post_cancel",
    "post_handshake",
    "sign",
]

HANDSHAKE_PATH = "/orbitkv/v1/handshake"
CANCEL_PATH = "/orbitkv/v1/cancel"
HEALTH_PATH = "/orbitkv/v1/health"
SIGNATURE_HEADER = "X-OrbitKV-Signature"
# The server's defaults (`orbitkv.SideChannel`).
MAX_BODY = 16 << 20
READ_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64


def sign(key: bytes, body: bytes) -> str:
    """The signature header value for ``body`` under the deployment key."""
    return "sha256=" + hmac.new(key, body, hashlib.sha256).hexdigest()


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
        if not isinstance(detail, dict):
            detail = {}
        error = detail.get("error", e.code)
        raise HandshakeRejected(
            f"{address} refused the {what}: {error}: {detail.get('message', '')}", e.code, error=str(error)
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
