//! Typed errors. Every variant names the cause and, where there is one, the fix.
//! The Python binding maps each variant family to its own exception class.

use std::path::PathBuf;

use serde::Serialize;

/// Errors from the transport layer (Mooncake through FFI).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq, Serialize)]
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
        #[serde(rename = "distribution")]
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
    UnregisteredLocal {
        addr: u64,
        #[serde(rename = "length")]
        len: u64,
    },

    /// A remote range is not inside memory the peer registered.
    #[error("remote range [{addr:#x}, +{len}) on {peer} is not inside memory the peer registered")]
    UnregisteredRemote {
        peer: String,
        addr: u64,
        #[serde(rename = "length")]
        len: u64,
    },

    /// Registration of a region failed or overlaps an existing one.
    #[error("register_memory([{addr:#x}, +{len})) failed: {reason}")]
    Registration {
        addr: u64,
        #[serde(rename = "length")]
        len: u64,
        reason: String,
    },

    /// A batch was submitted but failed as a whole.
    #[error("transfer batch to {peer} failed: {reason}")]
    TransferFailed { peer: String, reason: String },

    /// A batch did not finish before its deadline.
    #[error("transfer batch to {peer} timed out after {millis} ms")]
    Timeout {
        peer: String,
        #[serde(rename = "timeout_s", serialize_with = "details::millis_as_seconds")]
        millis: u64,
    },

    /// A notification could not be sent.
    #[error("notification to {peer} failed: {reason}")]
    NotifyFailed { peer: String, reason: String },

    /// An argument is invalid (empty batch, zero-length range, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(#[serde(serialize_with = "details::reason")] String),

    /// Any other error reported by Mooncake through the shim.
    #[error("Mooncake: {0}")]
    Mooncake(#[serde(serialize_with = "details::reason")] String),

    /// The CUDA driver (used to order writes after the GPU wrote a layer)
    /// could not be loaded or reported an error.
    #[error("CUDA: {0}")]
    Cuda(#[serde(serialize_with = "details::reason")] String),
}

pub type TransportResult<T> = Result<T, TransportError>;

/// A KV geometry that is inconsistent, or two geometries that do not fit.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum GeometryError {
    #[error("layout has no layers")]
    NoLayers,
    #[error("layer {layer} has {found} planes, layer 0 has {expected}")]
    PlaneCount {
        layer: u32,
        found: usize,
        expected: usize,
    },
    #[error("layer {layer} plane {plane}: {reason}")]
    BadPlane {
        layer: u32,
        plane: usize,
        reason: String,
    },
    #[error("layer {a_layer} plane {a_plane} overlaps layer {b_layer} plane {b_plane}")]
    Overlap {
        a_layer: u32,
        a_plane: usize,
        b_layer: u32,
        b_plane: usize,
    },
    #[error("block id {block} is outside the region of {num_blocks} blocks")]
    BlockOutOfRange { block: u32, num_blocks: u32 },
    #[error("block id {block} is listed twice")]
    DuplicateBlock { block: u32 },
    #[error("tensor parallel: {0}")]
    TensorParallel(String),
    #[error("producer has {producer} layers, consumer has {consumer}")]
    LayerCount { producer: usize, consumer: usize },
    #[error(
        "layer {layer} plane {plane}: {what} per head differs (producer {producer}, consumer {consumer})"
    )]
    HeadBytes {
        layer: u32,
        plane: usize,
        what: &'static str,
        producer: u64,
        consumer: u64,
    },
    #[error("layer {layer} is outside the layout's {num_layers} layers")]
    LayerOutOfRange { layer: u32, num_layers: usize },
    #[error("request block index {index} is outside the {authorized} authorized destination blocks")]
    OutsideAuthorization { index: u32, authorized: usize },
    #[error("request block index {index} is outside the producer's {available} source blocks")]
    OutsideSource { index: u32, available: usize },
    #[error(
        "request block index {index} of layer {layer}: the producer no longer holds its source block \
         (freed and given back) but the consumer needs it"
    )]
    SourceReleased { layer: u32, index: u32 },
    #[error("a staged write of {len} bytes at {dst:#x} is outside the staging grant of {grant} bytes at {base:#x}")]
    OutsideStagingGrant {
        dst: u64,
        len: u64,
        base: u64,
        grant: u64,
    },
    #[error("a staging grant at address 0, or staging addresses or sizes that overflow")]
    StagingOverflow,
    #[error("a staged chunk of request blocks {start}..{end} gathered in another order than a {what} can be written from")]
    GatherOrder {
        start: u32,
        end: u32,
        what: &'static str,
    },
    #[error("staging grant of {granted} bytes is smaller than the {needed} bytes its blocks stage to")]
    StagingTooSmall { granted: u64, needed: u64 },
    #[error("KV cache groups: {0}")]
    Groups(String),
    #[error("blocks of {producer} tokens on the producer, {consumer} on the consumer: {why}")]
    TokenOrder {
        producer: u32,
        consumer: u32,
        why: String,
    },
}

/// Text that came from a stranger (a serde error naming an unknown field,
/// a path, an endpoint), made safe to log or send back: control characters
/// and every whitespace but the space escaped (`char::escape_debug`: a
/// `\n` or a U+2028 cannot start a forged log line) and cut after `max`
/// characters of the escaped text, with `…` where it was cut. The result is
/// at most `max` characters plus the ellipsis, whatever the input's size;
/// applied twice it changes nothing more (a backslash is kept as it is).
pub fn untrusted(text: &str, max: usize) -> String {
    let mut out = String::with_capacity(max.min(text.len()) + 3);
    let mut n = 0;
    for c in text.chars() {
        let plain = !c.is_control() && (c == ' ' || !c.is_whitespace());
        let len = if plain { 1 } else { c.escape_debug().count() };
        if n + len > max {
            out.push('…');
            return out;
        }
        if plain {
            out.push(c);
        } else {
            out.extend(c.escape_debug());
        }
        n += len;
    }
    out
}

/// How much of a parser's error message (which may quote the input) a
/// [`ProtocolError::Malformed`] keeps ([`untrusted`]).
pub const MAX_PARSE_ERROR: usize = 128;

/// A handshake or notification that cannot be admitted.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ProtocolError {
    #[error("malformed {what}: {reason}")]
    Malformed { what: &'static str, reason: String },
    #[error("unsupported wire version {found} (this build speaks {supported})")]
    Version { found: u32, supported: u32 },
    #[error("bad geometry in handshake: {0}")]
    Geometry(#[from] GeometryError),
    #[error("bad endpoint in handshake: {0}")]
    Endpoint(String),
}

/// Errors of the request runtime (the actor system and its façade).
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq, Serialize)]
pub enum RuntimeError {
    #[error(transparent)]
    Transport(#[from] TransportError),
    #[error(transparent)]
    Protocol(
        #[from]
        #[serde(serialize_with = "details::reason_display")]
        ProtocolError,
    ),
    #[error(transparent)]
    Geometry(
        #[from]
        #[serde(serialize_with = "details::reason_display")]
        GeometryError,
    ),
    #[error("unknown request {0}")]
    UnknownRequest(#[serde(serialize_with = "details::request_id")] String),
    #[error("request {request}: generation {got} is stale (current {current})")]
    StaleGeneration {
        #[serde(rename = "request_id")]
        request: String,
        got: u64,
        current: u64,
    },
    #[error("request {0} already exists on this side")]
    DuplicateRequest(#[serde(serialize_with = "details::request_id")] String),
    /// A handshake or cancel without the request's capability: refused,
    /// and nothing about the request changes.
    #[error("request {request}: forbidden: {reason}")]
    Forbidden {
        #[serde(rename = "request_id")]
        request: String,
        reason: String,
    },
    /// A bounded resource (parked handshakes, remembered cancels) is full.
    #[error("overloaded: {0}")]
    Overloaded(#[serde(serialize_with = "details::reason")] String),
    #[error("the runtime has stopped")]
    Stopped,
    /// A runtime setting or call argument out of range (raised as
    /// `InvalidArgumentError`, like the transport's own).
    #[error("invalid argument: {0}")]
    InvalidArgument(#[serde(serialize_with = "details::reason")] String),
}

/// The side channel (`src/side_channel`) could not start.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq, Serialize)]
pub enum SideChannelError {
    /// Something else listens on that address.
    #[error("cannot listen on {address}: the address is in use (another side channel, or another program, listens there); pick another port")]
    AddressInUse { address: String },
    /// The address cannot be listened on (not a local address, no permission, ...).
    #[error("cannot listen on {address}: {reason}")]
    Bind { address: String, reason: String },
    /// A setting is out of range.
    #[error("invalid side channel setting: {0}")]
    InvalidArgument(#[serde(serialize_with = "details::reason")] String),
    /// The server's threads did not start.
    #[error("the side channel did not start: {0}")]
    Start(#[serde(serialize_with = "details::reason")] String),
}

// ---- The Python class of each error -------------------------------------------
//
// One table, used by the Python binding (the exception it raises) and by the
// side channel (the `error` field of a refusal), so both name an error the
// same way. The classes are defined in `bindings/python/python/orbitkv/errors.py`.

impl TransportError {
    /// The `orbitkv.errors` class this error is raised as in Python.
    pub fn class_name(&self) -> &'static str {
        match self {
            Self::LibraryNotFound { .. } | Self::LoadFailed { .. } | Self::LibPythonNotFound { .. } => {
                "MooncakeLibraryError"
            }
            Self::VersionMismatch { .. } => "MooncakeVersionError",
            Self::EngineInit { .. } => "EngineInitError",
            Self::BadEndpoint { .. } => "BadEndpointError",
            Self::UnregisteredLocal { .. } | Self::UnregisteredRemote { .. } => "UnregisteredMemoryError",
            Self::Registration { .. } => "RegistrationError",
            Self::TransferFailed { .. } => "TransferError",
            Self::Timeout { .. } => "TransferTimeoutError",
            Self::NotifyFailed { .. } => "NotificationError",
            Self::InvalidArgument(_) => "InvalidArgumentError",
            Self::Mooncake(_) => "MooncakeError",
            Self::Cuda(_) => "CudaError",
        }
    }

    /// The variant's name (`kind` of the Python exception).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::LibraryNotFound { .. } => "LibraryNotFound",
            Self::VersionMismatch { .. } => "VersionMismatch",
            Self::LoadFailed { .. } => "LoadFailed",
            Self::LibPythonNotFound { .. } => "LibPythonNotFound",
            Self::EngineInit { .. } => "EngineInit",
            Self::BadEndpoint { .. } => "BadEndpoint",
            Self::UnregisteredLocal { .. } => "UnregisteredLocal",
            Self::UnregisteredRemote { .. } => "UnregisteredRemote",
            Self::Registration { .. } => "Registration",
            Self::TransferFailed { .. } => "TransferFailed",
            Self::Timeout { .. } => "Timeout",
            Self::NotifyFailed { .. } => "NotifyFailed",
            Self::InvalidArgument(_) => "InvalidArgument",
            Self::Mooncake(_) => "Mooncake",
            Self::Cuda(_) => "Cuda",
        }
    }
}

impl RuntimeError {
    /// The `orbitkv.errors` class this error is raised as in Python, and the
    /// `error` the side channel answers with.
    pub fn class_name(&self) -> &'static str {
        match self {
            Self::Transport(e) => e.class_name(),
            Self::Protocol(_) => "HandshakeError",
            Self::Geometry(_) => "GeometryError",
            Self::UnknownRequest(_) => "UnknownRequestError",
            Self::StaleGeneration { .. } => "StaleGenerationError",
            Self::DuplicateRequest(_) => "DuplicateRequestError",
            Self::Forbidden { .. } => "ForbiddenError",
            Self::Overloaded(_) => "OverloadedError",
            Self::Stopped => "RuntimeStoppedError",
            Self::InvalidArgument(_) => "InvalidArgumentError",
        }
    }

    /// The variant's name (`kind` of the Python exception).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Transport(e) => e.kind(),
            Self::Protocol(_) => "Protocol",
            Self::Geometry(_) => "Geometry",
            Self::UnknownRequest(_) => "UnknownRequest",
            Self::StaleGeneration { .. } => "StaleGeneration",
            Self::DuplicateRequest(_) => "DuplicateRequest",
            Self::Forbidden { .. } => "Forbidden",
            Self::Overloaded(_) => "Overloaded",
            Self::Stopped => "Stopped",
            Self::InvalidArgument(_) => "InvalidArgument",
        }
    }
}

impl SideChannelError {
    /// The `orbitkv.errors` class this error is raised as in Python.
    pub fn class_name(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "InvalidArgumentError",
            Self::AddressInUse { .. } | Self::Bind { .. } | Self::Start(_) => "SideChannelError",
        }
    }

    /// The variant's name (`kind` of the Python exception).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::AddressInUse { .. } => "AddressInUse",
            Self::Bind { .. } => "Bind",
            Self::InvalidArgument(_) => "InvalidArgument",
            Self::Start(_) => "Start",
        }
    }
}

/// How an error's fields serialize as the `details` of its Python exception
/// (`exc.details`): the derived `Serialize` of an error is `{variant: {field:
/// value, ...}}`, or the variant's name alone when it has no fields; a
/// variant with one unnamed field names it with one of these.
mod details {
    use serde::ser::{SerializeMap, Serializer};

    fn one<S: Serializer>(key: &str, value: &str, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(1))?;
        map.serialize_entry(key, value)?;
        map.end()
    }

    /// `{"reason": text}`.
    pub(super) fn reason<S: Serializer>(text: &str, s: S) -> Result<S::Ok, S::Error> {
        one("reason", text, s)
    }

    /// `{"reason": the error's message}`.
    pub(super) fn reason_display<S: Serializer, E: std::fmt::Display>(
        e: &E,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        one("reason", &e.to_string(), s)
    }

    /// `{"request_id": id}`.
    pub(super) fn request_id<S: Serializer>(id: &str, s: S) -> Result<S::Ok, S::Error> {
        one("request_id", id, s)
    }

    /// A deadline in milliseconds, as seconds.
    pub(super) fn millis_as_seconds<S: Serializer>(millis: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(*millis as f64 / 1000.0)
    }
}

#[cfg(test)]
mod untrusted_tests {
    use super::untrusted;

    #[test]
    fn untrusted_text_is_escaped_cut_and_stable() {
        let forged = "x\n2026-01-01T00:00:00Z  WARN forged\r\u{2028}\u{1b}[31m";
        let once = untrusted(forged, 200);
        assert!(!once.chars().any(|c| c.is_control() || c == '\u{2028}'), "{once}");
        assert!(
            once.starts_with("x\\n2026") && once.contains("\\u{2028}"),
            "{once}"
        );
        assert_eq!(untrusted(&once, 200), once, "escaping twice changes nothing");
        let cut = untrusted(&"y".repeat(4 << 20), 64);
        assert_eq!(cut.chars().count(), 65);
        assert!(cut.ends_with('…'));
        // An escape is never split.
        assert_eq!(untrusted("ab\n", 3), "ab…");
        assert_eq!(untrusted("a \"b\"", 10), "a \"b\"");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The details a Python exception carries are the variant's fields under
    /// their Python names: renamed, converted, and one unnamed field named.
    #[test]
    fn details_serialize_under_their_python_names() {
        fn v(e: &impl Serialize) -> serde_json::Value {
            serde_json::to_value(e).unwrap()
        }
        assert_eq!(
            v(&TransportError::Timeout {
                peer: "p".into(),
                millis: 1500
            }),
            json!({"Timeout": {"peer": "p", "timeout_s": 1.5}})
        );
        assert_eq!(
            v(&TransportError::UnregisteredRemote {
                peer: "p".into(),
                addr: 7,
                len: 8
            }),
            json!({"UnregisteredRemote": {"peer": "p", "addr": 7, "length": 8}})
        );
        assert_eq!(
            v(&TransportError::InvalidArgument("bad".into())),
            json!({"InvalidArgument": {"reason": "bad"}})
        );
        assert_eq!(
            v(&RuntimeError::UnknownRequest("r1".into())),
            json!({"UnknownRequest": {"request_id": "r1"}})
        );
        assert_eq!(
            v(&RuntimeError::Forbidden {
                request: "r1".into(),
                reason: "no".into()
            }),
            json!({"Forbidden": {"request_id": "r1", "reason": "no"}})
        );
        assert_eq!(
            v(&RuntimeError::Geometry(GeometryError::NoLayers)),
            json!({"Geometry": {"reason": "layout has no layers"}})
        );
        assert_eq!(v(&RuntimeError::Stopped), json!("Stopped"));
        assert_eq!(
            v(&SideChannelError::Start("x".into())),
            json!({"Start": {"reason": "x"}})
        );
    }

    /// Every class the table names exists in the Python package.
    #[test]
    fn every_class_name_is_a_class_of_orbitkv_errors() {
        let py = include_str!("../bindings/python/python/orbitkv/errors.py");
        let t = |s: &str| TransportError::Mooncake(s.into());
        let all: Vec<RuntimeError> = vec![
            TransportError::LibraryNotFound {
                searched: String::new(),
                pinned: "",
            }
            .into(),
            TransportError::VersionMismatch {
                found: String::new(),
                pinned: "",
                dist: String::new(),
                path: PathBuf::new(),
            }
            .into(),
            TransportError::EngineInit {
                bind_host: String::new(),
                reason: String::new(),
            }
            .into(),
            TransportError::BadEndpoint {
                endpoint: String::new(),
                reason: String::new(),
            }
            .into(),
            TransportError::UnregisteredLocal { addr: 0, len: 0 }.into(),
            TransportError::Registration {
                addr: 0,
                len: 0,
                reason: String::new(),
            }
            .into(),
            TransportError::TransferFailed {
                peer: String::new(),
                reason: String::new(),
            }
            .into(),
            TransportError::Timeout {
                peer: String::new(),
                millis: 0,
            }
            .into(),
            TransportError::NotifyFailed {
                peer: String::new(),
                reason: String::new(),
            }
            .into(),
            TransportError::InvalidArgument(String::new()).into(),
            TransportError::Cuda(String::new()).into(),
            t("x").into(),
            ProtocolError::Endpoint(String::new()).into(),
            GeometryError::NoLayers.into(),
            RuntimeError::UnknownRequest(String::new()),
            RuntimeError::InvalidArgument(String::new()),
            RuntimeError::StaleGeneration {
                request: String::new(),
                got: 0,
                current: 0,
            },
            RuntimeError::DuplicateRequest(String::new()),
            RuntimeError::Forbidden {
                request: String::new(),
                reason: String::new(),
            },
            RuntimeError::Overloaded(String::new()),
            RuntimeError::Stopped,
        ];
        let side: Vec<SideChannelError> = vec![
            SideChannelError::AddressInUse {
                address: String::new(),
            },
            SideChannelError::Bind {
                address: String::new(),
                reason: String::new(),
            },
            SideChannelError::InvalidArgument(String::new()),
            SideChannelError::Start(String::new()),
        ];
        let names = all
            .iter()
            .map(|e| (e.class_name(), e.kind()))
            .chain(side.iter().map(|e| (e.class_name(), e.kind())));
        for (class, kind) in names {
            assert!(
                py.contains(&format!("\nclass {class}(")),
                "{class} is not in orbitkv/errors.py"
            );
            assert!(!kind.is_empty());
        }
    }
}
