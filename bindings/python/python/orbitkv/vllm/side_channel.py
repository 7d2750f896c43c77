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
many handshakes waiting or too many connections. The client is the Rust
core's (``orbitkv::side_channel::client::post``, the one decode's publisher
uses), and the paths and defaults are the core's. Imports nothing from vLLM.
"""

from __future__ import annotations

import json

from orbitkv import _native
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

# The protocol's constants and the server's defaults, written once in the
# Rust core (`orbitkv::side_channel`, `SideChannelConfig::default()`).
HANDSHAKE_PATH: str = _native.SIDE_CHANNEL_HANDSHAKE_PATH
CANCEL_PATH: str = _native.SIDE_CHANNEL_CANCEL_PATH
HEALTH_PATH: str = _native.SIDE_CHANNEL_HEALTH_PATH
SIGNATURE_HEADER: str = _native.SIDE_CHANNEL_SIGNATURE_HEADER
MAX_BODY = int(_native.SIDE_CHANNEL_DEFAULTS["max_body"])
READ_TIMEOUT_S = float(_native.SIDE_CHANNEL_DEFAULTS["read_timeout_s"])
MAX_CONNECTIONS = int(_native.SIDE_CHANNEL_DEFAULTS["max_connections"])


def sign(key: bytes, body: bytes) -> str:
    """The signature header value for ``body`` under the deployment key."""
    return _native.side_channel_sign(key, body)


def _post(address: str, path: str, body: str, timeout_s: float, key: bytes | None, what: str) -> None:
    # The core's client (the one decode's publisher uses); OSError when
    # nothing was answered (ConnectionRefusedError: nothing was delivered).
    status, reply = _native.side_channel_post(address, path, body, timeout_s, key)
    if status == 200:
        return
    try:
        detail = json.loads(reply or "{}")
    except ValueError:
        detail = {}
    if not isinstance(detail, dict):
        detail = {}
    error = detail.get("error", status)
    raise HandshakeRejected(
        f"{address} refused the {what}: {error}: {detail.get('message', '')}", status, error=str(error)
    )


def post_handshake(address: str, handshake_json: str, timeout_s: float = 5.0, key: bytes | None = None) -> None:
    """POSTs a handshake to a producer rank's side channel. Raises
    :class:`HandshakeRejected` when it answers with an error, ``OSError``
    (``ConnectionRefusedError`` when nothing listens there) when it cannot
    be reached."""
    _post(address, HANDSHAKE_PATH, handshake_json, timeout_s, key, "handshake")


def post_cancel(address: str, cancel_json: str, timeout_s: float = 5.0, key: bytes | None = None) -> None:
    """Tells a producer rank that the consumer gave a request up before
    authorizing anything (``cancel_json`` from ``orbitkv.cancel_message``),
    so it need not hold its source blocks until the handshake deadline.
    Raises :class:`HandshakeRejected` or ``OSError`` as :func:`post_handshake`."""
    _post(address, CANCEL_PATH, cancel_json, timeout_s, key, "cancellation")
