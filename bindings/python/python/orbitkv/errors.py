"""The exceptions OrbitKV raises.

Every exception derives from :class:`OrbitKVError`, so ``except OrbitKVError``
catches them all, and each error kind of the Rust core has its own class, so a
caller can tell a missing library from a bad endpoint from a failed transfer.

Every instance carries:

* ``kind``: the name of the Rust error variant (``"LibraryNotFound"``,
  ``"UnregisteredLocal"``, ...), or ``None`` for errors raised from Python;
* ``details``: that variant's fields (``peer``, ``addr``, ``length``,
  ``reason``, ...), also readable as attributes (``exc.peer``).

The table of Rust variants and Python classes is in ``docs/python.md``.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BadEndpointError",
    "CudaError",
    "DuplicateRequestError",
    "EngineClosedError",
    "EngineInitError",
    "ForbiddenError",
    "GeometryError",
    "HandshakeError",
    "HandshakeRejected",
    "InvalidArgumentError",
    "MooncakeError",
    "MooncakeLibraryError",
    "MooncakeVersionError",
    "NotificationError",
    "OrbitKVError",
    "OverloadedError",
    "RegistrationError",
    "RuntimeStoppedError",
    "SideChannelError",
    "StaleGenerationError",
    "TransferError",
    "TransferTimeoutError",
    "UnknownRequestError",
    "UnregisteredMemoryError",
]


class OrbitKVError(Exception):
    """Base class of every error OrbitKV raises."""

    kind: str | None
    details: dict[str, Any]

    def __init__(self, message: str, *, kind: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.kind = kind
        self.details = details

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: expose details as attributes.
        details = self.__dict__.get("details")
        if details is not None and name in details:
            return details[name]
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def __reduce__(self) -> Any:
        # Keep kind and details across pickling (multiprocessing).
        return (_rebuild, (type(self), str(self), self.kind, self.details))


def _rebuild(cls: type[OrbitKVError], message: str, kind: str | None, details: dict[str, Any]) -> OrbitKVError:
    return cls(message, kind=kind, **details)


# --- Loading Mooncake -------------------------------------------------------


class MooncakeLibraryError(OrbitKVError):
    """Mooncake's ``engine.so`` could not be found or loaded.

    ``kind`` is ``"LibraryNotFound"`` (nothing where we looked: install the
    pinned ``mooncake-transfer-engine-*`` wheel or set ``ORBITKV_MOONCAKE_LIB``),
    ``"LoadFailed"`` (dlopen or a needed symbol failed), or
    ``"LibPythonNotFound"`` (a process without Python found no libpython).
    """


class MooncakeVersionError(OrbitKVError):
    """The installed Mooncake is not the pinned version.

    ``details``: ``found``, ``pinned``, ``distribution``, ``path``. Install the
    pinned version, or accept this one with ``allow_version=`` /
    ``ORBITKV_MOONCAKE_ALLOW_VERSION``.
    """


# --- Engine -------------------------------------------------------------------


class EngineInitError(OrbitKVError):
    """Mooncake could not start an engine (bad bind host, no usable transport)."""


class EngineClosedError(OrbitKVError, RuntimeError):
    """The engine was closed; it (and its batches) can no longer be used."""


class BadEndpointError(OrbitKVError):
    """A peer endpoint is malformed (not ``host:port``) or names no reachable engine."""


# --- Memory -------------------------------------------------------------------


class UnregisteredMemoryError(OrbitKVError):
    """A range lies outside registered memory.

    ``side`` is ``"local"`` (a WRITE source not registered with this engine;
    register it with ``register_memory``) or ``"remote"`` (a destination the
    peer did not register, when Mooncake reports it at submission), from
    ``kind`` (``UnregisteredLocal`` or ``UnregisteredRemote``).
    """

    @property
    def side(self) -> str:
        return "remote" if self.kind == "UnregisteredRemote" else "local"


class RegistrationError(OrbitKVError):
    """Registering or unregistering a region failed (zero length, overlap,
    nothing registered at that address, or Mooncake refused it)."""


# --- Transfers and notifications ----------------------------------------------


class TransferError(OrbitKVError):
    """A batch of WRITEs failed (e.g. a destination the peer never registered,
    or the peer went away)."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A batch did not finish before its deadline (``details["timeout_s"]``)."""


class NotificationError(OrbitKVError):
    """A notification could not be sent to the peer."""


# --- Arguments and everything else --------------------------------------------


class InvalidArgumentError(OrbitKVError, ValueError):
    """An argument is invalid (empty batch, zero-length range, bad timeout, ...)."""


class MooncakeError(OrbitKVError):
    """Any other error Mooncake reported (batch status, notification queue)."""


class CudaError(OrbitKVError):
    """The CUDA driver (which orders a layer's write after the kernel that
    wrote it) could not be loaded or reported an error."""


# --- Request runtime -----------------------------------------------------------
# Mapped from the Rust `RuntimeError` variants in bindings/python/src/runtime.rs.


class HandshakeError(OrbitKVError):
    """A handshake (or layout JSON) cannot be admitted: malformed, an unknown
    wire version, a bad endpoint, or a changed authorization. Nothing was
    admitted."""


class GeometryError(OrbitKVError, ValueError):
    """KV geometry is inconsistent or does not fit: layouts of producer and
    consumer differ, a block ID is outside the region or listed twice, a layer
    or block range lies outside the authorization."""


class UnknownRequestError(OrbitKVError, KeyError):
    """A request ID this side does not know (never opened, or already released)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class StaleGenerationError(OrbitKVError):
    """An event carried another generation of a request ID than the one
    authorized now (generations are random: stale means not current, not
    older by value)."""


class DuplicateRequestError(OrbitKVError):
    """A request ID is still open on this side: release it before reusing it."""


class ForbiddenError(OrbitKVError, PermissionError):
    """A handshake or cancel did not carry the request's capability (the
    secret the router gave both halves): refused, nothing changed."""


class OverloadedError(OrbitKVError):
    """A bounded resource is full (handshakes parked before their request
    opened): refused, nothing changed; the sender may retry."""


class RuntimeStoppedError(OrbitKVError, RuntimeError):
    """The runtime was shut down."""


# --- Side channel -------------------------------------------------------------


class SideChannelError(OrbitKVError, OSError):
    """The side channel (``orbitkv.SideChannel``) could not start.

    ``kind`` is ``"AddressInUse"`` (something already listens on that port:
    another side channel, or another program; pick another port), ``"Bind"``
    (not an address of this host, or no permission) or ``"Start"`` (its
    threads did not start). ``details``: ``address``, ``reason``. Also an
    ``OSError``, as a failed ``bind`` is in Python.
    """


class HandshakeRejected(OrbitKVError, RuntimeError):
    """A producer rank's side channel refused a handshake or cancel
    (``orbitkv.vllm.side_channel.post_handshake`` / ``post_cancel``); nothing
    was admitted. ``status`` is the HTTP status (``400`` malformed, ``401``
    bad signature, ``403`` wrong capability, ``404``, ``408``, ``413``,
    ``503`` overloaded or busy); ``details["error"]`` the error the side
    channel named (``"ForbiddenError"``, ...), also in the message."""

    status: int

    def __init__(self, message: str, status: int, *, kind: str | None = None, **details: Any) -> None:
        super().__init__(message, kind=kind, status=status, **details)
        self.status = status
