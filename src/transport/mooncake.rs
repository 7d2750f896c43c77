//! The safe wrapper: `MooncakeTransferEngine`, the seed's native boundary.
//! Loading Mooncake is [`super::loader`]'s; its status codes, [`super::status`]'s.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{c_char, c_void, CString};
use std::path::PathBuf;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use super::ffi::{self, OkvEngine, OkvRange};
use super::kind::{mooncake_transport, TransportFacts, TransportKind};
use super::library::MooncakeLibrary;
pub use super::loader::{load_mooncake, redirect_submit_wait, submit_wait_counts};
use super::status::{submit_failure, TransferStatus};
use super::{BatchHandle, BatchState, Notification, WriteRange};
use crate::error::{TransportError, TransportResult};

/// How to start an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// Routable host (IP or name) this engine binds and advertises.
    pub bind_host: String,
    /// RDMA NICs to use (e.g. `["mlx5_0"]`); empty: Mooncake chooses (TCP
    /// where there is no RDMA device). `MC_FORCE_TCP=1` forces TCP.
    pub nics: Vec<String>,
    /// Explicit `engine.so` (or a folder holding it); else found at run time.
    pub library: Option<PathBuf>,
    /// Mooncake version accepted besides the pinned one.
    pub allow_version: Option<String>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            bind_host: "127.0.0.1".into(),
            nics: Vec::new(),
            library: None,
            allow_version: std::env::var("ORBITKV_MOONCAKE_ALLOW_VERSION").ok(),
        }
    }
}

fn cstring(s: &str, what: &str) -> TransportResult<CString> {
    CString::new(s).map_err(|_| TransportError::InvalidArgument(format!("{what} contains a NUL byte")))
}

pub use crate::ids::parse_endpoint;

/// A Mooncake Transfer Engine: P2PHANDSHAKE, no metadata service, no Store.
///
/// Thread-safe: Mooncake's `TransferEngine` serializes internally; the maps
/// kept here are behind locks.
pub struct MooncakeTransferEngine {
    raw: NonNull<OkvEngine>,
    endpoint: String,
    library: MooncakeLibrary,
    /// The transport Mooncake installed (as its rule gives it).
    kind: TransportKind,
    /// Local registered regions: start -> length.
    regions: RwLock<BTreeMap<u64, u64>>,
    /// Opened peer segments: endpoint -> segment handle.
    segments: Mutex<HashMap<String, u64>>,
}

// SAFETY: Mooncake's TransferEngine is used from many threads by upstream
// (its Python binding releases the GIL around every call); all of its public
// members lock internally. Our own state is behind parking_lot locks.
unsafe impl Send for MooncakeTransferEngine {}
// SAFETY: see Send above.
unsafe impl Sync for MooncakeTransferEngine {}

impl std::fmt::Debug for MooncakeTransferEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeTransferEngine")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl MooncakeTransferEngine {
    /// Loads Mooncake (once per process) and starts an engine.
    pub fn new(config: &EngineConfig) -> TransportResult<Self> {
        let library = load_mooncake(config.library.as_deref(), config.allow_version.as_deref())?;
        if config.bind_host.is_empty() {
            return Err(TransportError::EngineInit {
                bind_host: String::new(),
                reason: "empty bind host".into(),
            });
        }
        let host = cstring(&config.bind_host, "bind_host")?;
        let nics: Vec<CString> = config
            .nics
            .iter()
            .map(|n| cstring(n, "nic name"))
            .collect::<TransportResult<_>>()?;
        let nic_ptrs: Vec<*const c_char> = nics.iter().map(|c| c.as_ptr()).collect();
        // SAFETY: `host` and every element of `nic_ptrs` are valid C strings
        // that outlive the call; the shim copies them into std::string.
        let raw = unsafe { ffi::okv_engine_new(host.as_ptr(), nic_ptrs.as_ptr(), nic_ptrs.len()) };
        let raw = NonNull::new(raw).ok_or_else(|| TransportError::EngineInit {
            bind_host: config.bind_host.clone(),
            reason: ffi::last_error(),
        })?;
        let mut buf = vec![0 as c_char; 512];
        // SAFETY: `raw` is a live engine; `buf` has `buf.len()` writable bytes.
        let rc = unsafe { ffi::okv_engine_endpoint(raw.as_ptr(), buf.as_mut_ptr(), buf.len()) };
        if rc != 0 {
            let reason = ffi::last_error();
            // SAFETY: `raw` came from okv_engine_new and is freed once here.
            unsafe { ffi::okv_engine_free(raw.as_ptr()) };
            return Err(TransportError::EngineInit {
                bind_host: config.bind_host.clone(),
                reason,
            });
        }
        // SAFETY: the shim wrote a NUL-terminated string into `buf`.
        let endpoint = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let kind = mooncake_transport(&TransportFacts::of_this_host(
            library.distribution.as_deref(),
            &config.nics,
        ));
        tracing::info!(endpoint = %endpoint, nics = ?config.nics, transport = %kind, "mooncake engine started");
        Ok(Self {
            raw,
            endpoint,
            library,
            kind,
            regions: RwLock::new(BTreeMap::new()),
            segments: Mutex::new(HashMap::new()),
        })
    }

    /// The local Mooncake segment name (`ip:port`) peers open.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Which Mooncake library this engine runs on.
    pub fn library(&self) -> &MooncakeLibrary {
        &self.library
    }

    /// The transport Mooncake installed, by its own rule
    /// ([`super::kind`]): from the wheel's build, the environment and the
    /// host's RDMA devices.
    pub fn kind(&self) -> TransportKind {
        self.kind
    }

    /// Registers a long-lived region (`location` e.g. `cpu:0`, `cuda:1`;
    /// empty lets Mooncake detect it). Overlapping an existing region is an error.
    ///
    /// The caller keeps the memory alive and unmoved until `unregister_memory`.
    pub fn register_memory(&self, addr: u64, len: u64, location: &str) -> TransportResult<()> {
        let reg_err = |reason: String| TransportError::Registration { addr, len, reason };
        if addr == 0 || len == 0 {
            return Err(reg_err("null address or zero length".into()));
        }
        let end = addr
            .checked_add(len)
            .ok_or_else(|| reg_err("address range overflows".into()))?;
        let mut regions = self.regions.write();
        let before = regions.range(..end).next_back();
        if let Some((&s, &l)) = before {
            if s + l > addr {
                return Err(reg_err(format!("overlaps registered region [{s:#x}, +{l})")));
            }
        }
        let loc = cstring(if location.is_empty() { "*" } else { location }, "location")?;
        // SAFETY: live engine; the caller promised the region stays valid
        // until unregister_memory (documented above).
        let rc = unsafe { ffi::okv_register(self.raw.as_ptr(), addr, len, loc.as_ptr()) };
        if rc != 0 {
            return Err(reg_err(ffi::last_error()));
        }
        regions.insert(addr, len);
        Ok(())
    }

    /// Unregisters a region registered at exactly `addr`.
    pub fn unregister_memory(&self, addr: u64) -> TransportResult<()> {
        let mut regions = self.regions.write();
        let Some(len) = regions.get(&addr).copied() else {
            return Err(TransportError::Registration {
                addr,
                len: 0,
                reason: "no region registered at this address".into(),
            });
        };
        // SAFETY: live engine; `addr` is the start of a region we registered.
        let rc = unsafe { ffi::okv_unregister(self.raw.as_ptr(), addr) };
        if rc != 0 {
            return Err(TransportError::Registration {
                addr,
                len,
                reason: ffi::last_error(),
            });
        }
        regions.remove(&addr);
        Ok(())
    }

    /// True when `[addr, addr+len)` lies inside one registered local region.
    pub fn is_registered(&self, addr: u64, len: u64) -> bool {
        let regions = self.regions.read();
        match regions.range(..=addr).next_back() {
            Some((&s, &l)) => addr.checked_add(len).is_some_and(|end| end <= s + l),
            None => false,
        }
    }

    fn segment(&self, peer: &str) -> TransportResult<u64> {
        if let Some(&s) = self.segments.lock().get(peer) {
            return Ok(s);
        }
        parse_endpoint(peer)?;
        let name = cstring(peer, "endpoint")?;
        let mut seg = 0u64;
        // SAFETY: live engine, valid C string, `seg` is a valid out pointer.
        let rc = unsafe { ffi::okv_open_segment(self.raw.as_ptr(), name.as_ptr(), &mut seg) };
        if rc != 0 {
            return Err(TransportError::BadEndpoint {
                endpoint: peer.into(),
                reason: ffi::last_error(),
            });
        }
        // Opened without the lock (openSegment may wait for the peer): if
        // another thread opened this peer meanwhile, keep its segment and
        // close ours, so that none is left open and unreferenced.
        let mut segments = self.segments.lock();
        if let Some(&theirs) = segments.get(peer) {
            drop(segments);
            // Mooncake may hand out one ID per name: close only another one.
            if seg != theirs {
                // SAFETY: live engine; `seg` came from openSegment just above
                // and is referenced nowhere else.
                unsafe { ffi::okv_close_segment(self.raw.as_ptr(), seg) };
            }
            return Ok(theirs);
        }
        segments.insert(peer.to_string(), seg);
        Ok(seg)
    }

    /// Peer segments open now (one per peer written to and not forgotten).
    pub fn open_segments(&self) -> usize {
        self.segments.lock().len()
    }

    /// Forgets a peer's cached segment (after it restarted, say, or once
    /// the runtime's writers reclaimed it as idle) and closes it. Call it
    /// only with no batch to `peer` in flight. (Mooncake's `closeSegment`
    /// is a no-op upstream: its own metadata cache of the peer stays; the
    /// next write to `peer` opens it again through that cache.)
    pub fn forget_peer(&self, peer: &str) {
        if let Some(seg) = self.segments.lock().remove(peer) {
            // SAFETY: live engine; `seg` came from openSegment.
            unsafe { ffi::okv_close_segment(self.raw.as_ptr(), seg) };
        }
    }

    /// Submits a batch of WRITEs to `peer` without waiting. Every local source
    /// must lie in a registered region. Poll the handle with [`Self::poll`].
    pub fn submit_write(&self, peer: &str, ranges: &[WriteRange]) -> TransportResult<BatchHandle> {
        if ranges.is_empty() {
            return Err(TransportError::InvalidArgument("empty batch".into()));
        }
        let mut total = 0u64;
        for r in ranges {
            if r.len == 0 {
                return Err(TransportError::InvalidArgument(format!(
                    "zero-length range at src {:#x}",
                    r.src
                )));
            }
            if !self.is_registered(r.src, r.len) {
                return Err(TransportError::UnregisteredLocal {
                    addr: r.src,
                    len: r.len,
                });
            }
            total += r.len;
        }
        let seg = self.segment(peer)?;
        // A plan is handed over as it is: `WriteRange` is `#[repr(C)]` with
        // the fields of `OkvRange`, in the same order (checked at compile
        // time below).
        let raw = ranges.as_ptr().cast::<OkvRange>();
        let mut batch = 0u64;
        // SAFETY: live engine; `raw` points at `ranges.len()` ranges of the
        // FFI's layout that outlive the call (the shim copies them before it
        // returns); the sources were checked to be registered local memory.
        let rc = unsafe { ffi::okv_submit_write(self.raw.as_ptr(), seg, raw, ranges.len(), &mut batch) };
        if rc != 0 {
            return Err(submit_failure(peer, ranges, rc, ffi::last_error()));
        }
        Ok(BatchHandle {
            id: batch,
            peer: peer.to_string(),
            tasks: ranges.len(),
            bytes: total,
            submitted: Instant::now(),
        })
    }

    /// Polls a batch. A terminal state frees the batch inside Mooncake; poll
    /// a handle again after that and you get `InvalidArgument`.
    pub fn poll(&self, handle: &mut BatchHandle) -> TransportResult<BatchState> {
        if handle.id == 0 {
            return Err(TransportError::InvalidArgument("batch already finished".into()));
        }
        let (mut state, mut bytes) = (0i32, 0u64);
        // SAFETY: live engine; `handle.id` is a batch we allocated and have not freed.
        let rc = unsafe { ffi::okv_batch_status(self.raw.as_ptr(), handle.id, &mut state, &mut bytes) };
        if rc != 0 {
            return Err(TransportError::Mooncake(ffi::last_error()));
        }
        let out = match TransferStatus::from_raw(state) {
            Some(TransferStatus::Waiting | TransferStatus::Pending) => return Ok(BatchState::InFlight),
            Some(TransferStatus::Completed) => BatchState::Completed { bytes: handle.bytes },
            other => BatchState::Failed {
                reason: self.failure_reason(handle, other),
            },
        };
        self.release(handle);
        Ok(out)
    }

    fn failure_reason(&self, handle: &BatchHandle, state: Option<TransferStatus>) -> String {
        let name = TransferStatus::name_of(state);
        // Find the first failed task, for a useful message.
        for task in 0..handle.tasks as u64 {
            let (mut s, mut b) = (0i32, 0u64);
            // SAFETY: live engine, batch not yet freed, task < task count.
            let rc = unsafe { ffi::okv_task_status(self.raw.as_ptr(), handle.id, task, &mut s, &mut b) };
            let s = TransferStatus::from_raw(s);
            if rc == 0 && s.map_or(true, TransferStatus::is_failure) {
                return format!(
                    "{name}: task {task} of {} ended {}",
                    handle.tasks,
                    TransferStatus::name_of(s)
                );
            }
        }
        name.to_string()
    }

    fn release(&self, handle: &mut BatchHandle) {
        // SAFETY: live engine; the batch is terminal and freed exactly once
        // (the id is zeroed below).
        let rc = unsafe { ffi::okv_free_batch(self.raw.as_ptr(), handle.id) };
        if rc != 0 {
            tracing::warn!(batch = handle.id, error = %ffi::last_error(), "freeBatchID failed");
        }
        handle.id = 0;
    }

    /// Waits for a batch, with a deadline. On timeout the batch is left to
    /// Mooncake (its memory must stay registered) and `Timeout` is returned.
    pub fn wait(&self, mut handle: BatchHandle, timeout: Duration) -> TransportResult<u64> {
        let deadline = handle.submitted + timeout;
        match super::wait_batch(deadline, || self.poll(&mut handle), |_| Ok(()))? {
            super::BatchEnd::Completed(bytes) => Ok(bytes),
            super::BatchEnd::Failed(reason) => Err(TransportError::TransferFailed {
                peer: handle.peer.clone(),
                reason,
            }),
            super::BatchEnd::TimedOut => Err(TransportError::Timeout {
                peer: handle.peer.clone(),
                millis: timeout.as_millis() as u64,
            }),
        }
    }

    /// Submits a batch and waits for it (the seed's first implementation).
    pub fn write(&self, peer: &str, ranges: &[WriteRange], timeout: Duration) -> TransportResult<u64> {
        let h = self.submit_write(peer, ranges)?;
        self.wait(h, timeout)
    }

    /// Sends a notification (`name`, `message`) to a peer's endpoint.
    ///
    /// `message` must be UTF-8 (any UTF-8, NUL included): Mooncake carries
    /// notifications as JSON text and replaces invalid UTF-8 with U+FFFD on
    /// the way (measured with 0.3.13.post1), so other bytes are refused with
    /// `InvalidArgument` instead of arriving altered.
    pub fn send_notification(&self, peer: &str, name: &str, message: &[u8]) -> TransportResult<()> {
        parse_endpoint(peer)?;
        if let Err(e) = std::str::from_utf8(message) {
            return Err(TransportError::InvalidArgument(format!(
                "notification message is not UTF-8 ({e}); Mooncake would alter it in transit: \
                 encode binary payloads (e.g. hex or base64) first"
            )));
        }
        let p = cstring(peer, "endpoint")?;
        // SAFETY: live engine; name/message pointers with their lengths are
        // valid for the call; the shim copies them into std::string.
        let rc = unsafe {
            ffi::okv_send_notify(
                self.raw.as_ptr(),
                p.as_ptr(),
                name.as_ptr().cast(),
                name.len(),
                message.as_ptr().cast(),
                message.len(),
            )
        };
        if rc != 0 {
            return Err(TransportError::NotifyFailed {
                peer: peer.into(),
                reason: ffi::last_error(),
            });
        }
        Ok(())
    }

    /// Drains the notifications that arrived since the last call.
    pub fn take_notifications(&self) -> TransportResult<Vec<Notification>> {
        unsafe extern "C" fn push(
            ctx: *mut c_void,
            name: *const c_char,
            name_len: usize,
            msg: *const c_char,
            msg_len: usize,
        ) {
            // SAFETY: `ctx` is the `&mut Vec<Notification>` passed below, alive
            // for the whole okv_take_notifies call; name/msg point at
            // `*_len` readable bytes owned by the shim during the callback.
            let (out, name, msg) = unsafe {
                (
                    &mut *(ctx as *mut Vec<Notification>),
                    std::slice::from_raw_parts(name as *const u8, name_len),
                    std::slice::from_raw_parts(msg as *const u8, msg_len),
                )
            };
            out.push(Notification {
                name: String::from_utf8_lossy(name).into_owned(),
                message: msg.to_vec(),
            });
        }
        let mut out: Vec<Notification> = Vec::new();
        // SAFETY: live engine; `push` matches OkvNotifyCb and cannot unwind
        // (it only allocates); `out` outlives the call.
        let rc = unsafe {
            ffi::okv_take_notifies(
                self.raw.as_ptr(),
                push,
                (&mut out as *mut Vec<Notification>).cast(),
            )
        };
        if rc < 0 {
            return Err(TransportError::Mooncake(ffi::last_error()));
        }
        Ok(out)
    }
}

impl Drop for MooncakeTransferEngine {
    fn drop(&mut self) {
        let segs: Vec<u64> = self.segments.lock().drain().map(|(_, s)| s).collect();
        for s in segs {
            // SAFETY: live engine; each segment came from openSegment.
            unsafe { ffi::okv_close_segment(self.raw.as_ptr(), s) };
        }
        let regions: Vec<u64> = self.regions.write().keys().copied().collect();
        for addr in regions {
            // SAFETY: live engine; each address is a region we registered.
            unsafe { ffi::okv_unregister(self.raw.as_ptr(), addr) };
        }
        // SAFETY: `raw` came from okv_engine_new and is freed exactly once here.
        unsafe { ffi::okv_engine_free(self.raw.as_ptr()) };
    }
}

// `submit_write` hands a `&[WriteRange]` to the FFI as `OkvRange`s.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<WriteRange>() == size_of::<OkvRange>());
    assert!(align_of::<WriteRange>() == align_of::<OkvRange>());
    assert!(offset_of!(WriteRange, src) == offset_of!(OkvRange, src));
    assert!(offset_of!(WriteRange, dst) == offset_of!(OkvRange, dst));
    assert!(offset_of!(WriteRange, len) == offset_of!(OkvRange, len));
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_endpoint("127.0.0.1:15821").unwrap(),
            ("127.0.0.1".into(), 15821)
        );
        assert_eq!(parse_endpoint("[::1]:80").unwrap(), ("::1".into(), 80));
        for bad in [
            "",
            "127.0.0.1",
            ":80",
            "host:0",
            "host:99999",
            "host:abc",
            "a b:1",
            "h/x:1",
        ] {
            assert!(
                matches!(parse_endpoint(bad), Err(TransportError::BadEndpoint { .. })),
                "{bad}"
            );
        }
    }
}
