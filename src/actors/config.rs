//! The runtime's settings ([`RuntimeConfig`]) and their checks, apart from
//! the façade that uses them.

use std::sync::Arc;
use std::time::Duration;

use crate::error::RuntimeError;

/// Runtime settings. Defaults suit a CPU or GPU P/D pair on one network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeConfig {
    /// How long a consumer waits for all producers before failing the request.
    pub consumer_timeout: Duration,
    /// How long, after `consumer_timeout`, a consumer keeps the blocks of
    /// producers that never ended (their writes may still be queued in
    /// Mooncake, e.g. behind a cut link, and land when it heals); and how
    /// long, after `write_timeout`, a producer waits for Mooncake to end a
    /// late batch before it gives the batch up.
    pub quarantine: Duration,
    /// How long a producer waits for the consumer's handshake.
    pub handshake_timeout: Duration,
    /// How long one write batch may take before it counts as failed.
    pub write_timeout: Duration,
    /// Bytes in flight per peer before further layers queue.
    pub max_bytes_in_flight_per_peer: u64,
    /// Ranges in flight per peer; a layer with more goes out as several
    /// batches. Mooncake's TCP transport queues at most 1024 transfers per
    /// peer by default (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`).
    pub max_ranges_in_flight_per_peer: usize,
    /// Writers per peer (threads that submit to Mooncake in turn, sharing
    /// the per-peer budgets).
    pub writer_lanes_per_peer: usize,
    /// Prefill side: a peer (decode endpoint) whose writers had nothing to
    /// do and no request held them for this long has its writer lanes
    /// (threads) stopped and its Mooncake segment closed; a later request
    /// to it starts them again. Checked every quarter of it (at least every
    /// 10 ms, at most every second) and whenever a new peer is seen.
    pub peer_idle_reclaim: Duration,
    /// A layer write of at most this many ranges, handed over without a
    /// layer mark, is submitted on the thread that called `layer_ready`
    /// when its writer is idle (0: always on the writer's thread).
    pub inline_submit_max_ranges: usize,
    /// How often the router drains Mooncake's notifications while a
    /// consumer waits for one (below 1 ms on a thread of its own, which
    /// parks while none waits; see [`super::router`]).
    pub notify_poll: Duration,
    /// Handshakes parked and cancels remembered before their request opened
    /// on this (prefill) side, all requests together; more are refused.
    pub max_parked: usize,
    /// Approximate bytes of parked handshakes; more are refused.
    pub max_parked_bytes: usize,
    /// The deployment key that signs the handshakes and cancels this
    /// (decode) rank sends (`None`: unsigned).
    pub side_channel_key: Option<Arc<Vec<u8>>>,
    /// How long one handshake or cancel POST may take.
    pub publish_timeout: Duration,
    /// Decode side: registered memory (`(address, bytes)`) that staging
    /// grants are given from (`crate::staging`); `None`: producers always
    /// write the pages directly.
    pub staging_region: Option<(u64, u64)>,
    /// Prefill side: registered memory the worker gathers requests into
    /// (each request's source staging must lie inside it); `None`: this
    /// rank never stages.
    pub source_staging_region: Option<(u64, u64)>,
    /// Decode side: a request gets a staging grant only when writing its
    /// pages directly would take at least this many ranges per layer.
    pub staging_min_ranges: usize,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            consumer_timeout: Duration::from_secs(120),
            quarantine: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(30),
            max_bytes_in_flight_per_peer: 1 << 30,
            max_ranges_in_flight_per_peer: 768,
            writer_lanes_per_peer: 4,
            peer_idle_reclaim: Duration::from_secs(60),
            inline_submit_max_ranges: 64,
            notify_poll: Duration::from_micros(250),
            max_parked: 4096,
            max_parked_bytes: 64 << 20,
            side_channel_key: None,
            publish_timeout: Duration::from_secs(10),
            staging_region: None,
            source_staging_region: None,
            staging_min_ranges: 16,
        }
    }
}

/// The staging regions are well formed and apart (a grant and a gather
/// must never share bytes).
pub(super) fn check_staging_regions(cfg: &RuntimeConfig) -> Result<(), RuntimeError> {
    let bad = |what: &str, (base, len): (u64, u64)| {
        invalid_argument(format!(
            "{what} of {len} bytes at {base:#x} is empty, at 0, or overflows"
        ))
    };
    for (what, r) in [
        ("staging_region", cfg.staging_region),
        ("source_staging_region", cfg.source_staging_region),
    ] {
        if let Some((base, len)) = r {
            if base == 0 || len == 0 || base.checked_add(len).is_none() {
                return Err(bad(what, (base, len)));
            }
        }
    }
    if let Some((base, len)) = cfg.staging_region {
        // The directory's arena over it (too small to hold one aligned piece: refused here).
        crate::staging::arena::StagingArena::new(base, len).map_err(|e| invalid_argument(e.to_string()))?;
    }
    if let (Some((a, al)), Some((b, bl))) = (cfg.staging_region, cfg.source_staging_region) {
        if a < b + bl && b < a + al {
            return Err(invalid_argument(
                "staging_region and source_staging_region overlap".into(),
            ));
        }
    }
    Ok(())
}

/// A setting or argument out of range (raised as `InvalidArgumentError`).
pub(super) fn invalid_argument(msg: String) -> RuntimeError {
    RuntimeError::InvalidArgument(msg)
}
