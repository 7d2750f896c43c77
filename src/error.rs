//! Typed errors. Every variant names the cause and, where there is one, the fix.
//! The Python binding maps each variant family to its own exception class.

use std::path::PathBuf;

/// Errors from the transport layer (Mooncake through FFI).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TransportError {
    /// No `engine.so` was found where we looked.
    #[error(
        "Mooncake library not found (looked in: {searched}). Fix: install \
             `mooncake-transfer-engine-non-cuda=={pinned}` (or a CUDA variant of the same \
             version) into the Python that runs OrbitKV, or set ORBITKV_MOONCAKE_LIB to \
             the path of its `mooncake/engine.so`"
    )]
    LibraryNotFound { searched: String, pinned: &'static str },

    /// The installed Mooncake is not the pinned version.
    #[error(
        "Mooncake version {found} at {path} is not the pinned {pinned}; OrbitKV \
             declares Mooncake's C++ data layouts for {pinned} only. Fix: `pip install \
             {dist}=={pinned}`, or set ORBITKV_MOONCAKE_ALLOW_VERSION={found} to accept \
             it at your own risk"
    )]
    VersionMismatch {
        found: String,
        pinned: &'static str,
        dist: String,
        path: PathBuf,
    },

    /// A needed symbol is missing from `engine.so`, or loading it failed.
    #[error("cannot load Mooncake from {path}: {reason}")]
    LoadFailed { path: PathBuf, reason: String },

    /// libpython could not be found for a process without a Python runtime.
    #[error(
        "Mooncake's engine.so is a Python extension and this process has no \
             libpython: {reason}. Fix: set ORBITKV_LIBPYTHON to the path of \
             libpython3.X.so, or ORBITKV_PYTHON to a python3 whose sysconfig names it"
    )]
    LibPythonNotFound { reason: String },

    /// Engine construction or `init` failed.
    #[error("Mooncake engine start-up failed (bind host {bind_host:?}): {reason}")]
    EngineInit { bind_host: String, reason: String },

    /// An endpoint string is malformed or names no reachable Mooncake engine.
    #[error("bad Mooncake endpoint {endpoint:?}: {reason}")]
    BadEndpoint { endpoint: String, reason: String },

    /// A local range is not inside memory registered with this engine.
    #[error(
        "local range [{addr:#x}, +{len}) is not inside a registered region; \
             register the tensor with register_memory first"
    )]
    UnregisteredLocal { addr: u64, len: u64 },

    /// A remote range is not inside memory the peer registered.
    #[error("remote range [{addr:#x}, +{len}) on {peer} is not inside memory the peer registered")]
    UnregisteredRemote { peer: String, addr: u64, len: u64 },

    /// Registration of a region failed or overlaps an existing one.
    #[error("register_memory([{addr:#x}, +{len})) failed: {reason}")]
    Registration { addr: u64, len: u64, reason: String },

    /// A batch was submitted but failed as a whole.
    #[error("transfer batch to {peer} failed: {reason}")]
    TransferFailed { peer: String, reason: String },

    /// A batch did not finish before its deadline.
    #[error("transfer batch to {peer} timed out after {millis} ms")]
    Timeout { peer: String, millis: u64 },

    /// A notification could not be sent.
    #[error("notification to {peer} failed: {reason}")]
    NotifyFailed { peer: String, reason: String },

    /// An argument is invalid (empty batch, zero-length range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Any other error reported by Mooncake through the shim.
    #[error("Mooncake: {0}")]
    Mooncake(String),
}

pub type TransportResult<T> = Result<T, TransportError>;
