"""OrbitKV: a vLLM prefill/decode KV-transfer connector with a Rust core.

The native boundary is :class:`MooncakeTransferEngine` (Mooncake Transfer
Engine, reached from Rust through a C++ shim; no Python on the data path);
:class:`Runtime` is a rank's request runtime (the P/D request actors), and
:class:`SideChannel` the HTTP server a prefill rank takes handshakes on.
Errors are the classes of :mod:`orbitkv.errors`, all derived from
:class:`OrbitKVError`. The vLLM connector lives in :mod:`orbitkv.vllm` and is
not imported here.
"""

from orbitkv import errors
from orbitkv._native import (
    PINNED_MOONCAKE_VERSION,
    Batch,
    MooncakeTransferEngine,
    Runtime,
    RuntimeEvent,
    SideChannel,
    StagingArena,
    cancel_message,
    install_trace,
    new_capability,
    producer_ranks,
)
from orbitkv._native import __version__ as __version__
from orbitkv.errors import *  # noqa: F403 (every error class, named once: errors.__all__)

__all__ = [
    "PINNED_MOONCAKE_VERSION",
    "Batch",
    "MooncakeTransferEngine",
    "Runtime",
    "RuntimeEvent",
    "SideChannel",
    "StagingArena",
    "__version__",
    "cancel_message",
    "install_trace",
    "new_capability",
    "producer_ranks",
]
__all__ += errors.__all__
