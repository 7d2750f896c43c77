"""OrbitKV: a vLLM prefill/decode KV-transfer connector with a Rust core.

The native boundary is :class:`MooncakeTransferEngine` (Mooncake Transfer
Engine, reached from Rust through a C++ shim; no Python on the data path);
:class:`Runtime` is a rank's request runtime (the P/D request actors), and
:class:`SideChannel` the HTTP server a prefill rank takes handshakes on.
Errors are the classes of :mod:`orbitkv.errors`, all derived from
:class:`OrbitKVError`. The vLLM connector lives in :mod:`orbitkv.vllm` and is
not imported here.
"""

from orbitkv import _native, errors
from orbitkv._native import *  # noqa: F403 (every native name, named once: _native.__all__)
from orbitkv.errors import *  # noqa: F403 (every error class, named once: errors.__all__)

# The native module's names (its stub's __all__ is checked against the module
# by stubtest) and the error classes. The runtime's counters and defaults are
# left out of __all__: orbitkv.vllm reads them from orbitkv._native.
__all__: list[str] = []
__all__ += [name for name in _native.__all__ if not name.startswith("_")]
__all__ += errors.__all__
__all__.remove("RUNTIME_DEFAULTS")
__all__.remove("RUNTIME_SETTINGS")
__all__.remove("DEFAULT_RANGES_IN_FLIGHT")
__all__.remove("STATS_FIELDS")
for _name in _native.__all__:  # the side channel's protocol: orbitkv.vllm.side_channel names it
    if _name.startswith(("SIDE_CHANNEL_", "side_channel_")):
        __all__.remove(_name)
