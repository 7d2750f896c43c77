//! The runtime's settings ([`RuntimeConfig`]) and their checks, apart from
//! the façade that uses them.

use std::sync::Arc;
use std::time::Duration;

use crate::error::RuntimeError;
use crate::transport::TransportKind;

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
    /// batches. `None`: the transport's default
    /// ([`TransportKind::default_ranges_in_flight`]: 8192 on the intra-node
    /// NVLink transport, 768 otherwise), resolved when the runtime starts
    /// ([`crate::actors::Runtime::config`] then holds the number). Mooncake's
    /// TCP transport queues at most 1024 transfers per peer by default
    /// (`MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER`) and fails the rest.
    pub max_ranges_in_flight_per_peer: Option<usize>,
    /// Writers per peer (threads that submit to Mooncake in turn, sharing
    /// the per-peer budgets); each peer also has one thread that sends its
    /// notices and takes no write.
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
    /// parks while none waits; see [`super::decode::router`]).
    pub notify_poll: Duration,
    /// Handshakes parked and cancels remembered before their request opened
    /// on this (prefill) side, all requests together; more are refused.
    pub max_parked: usize,
    /// Approximate bytes of parked handshakes and remembered cancels; more
    /// are refused.
    pub max_parked_bytes: usize,
    /// Of `max_parked`, how many one source address (the side channel's
    /// peer; an IPv6 one's /64) may hold (`super::prefill::preopen`); `None`: a
    /// quarter of `max_parked` ([`Self::parked_per_source`]).
    pub max_parked_per_source: Option<usize>,
    /// Of `max_parked_bytes`, how many one source address may hold;
    /// `None`: a quarter of `max_parked_bytes`.
    pub max_parked_bytes_per_source: Option<usize>,
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
    /// Prefill side, in place of `source_staging_region`: this rank stages
    /// by layer into segments it is given later
    /// (`Runtime::add_source_staging`: the blocks the scheduler took out of
    /// vLLM's KV cache); until then every layer is written from the pages.
    pub source_staging_later: bool,
    /// Decode side: a request gets a staging grant only when writing its
    /// pages directly would take at least this many ranges per layer.
    pub staging_min_ranges: usize,
    /// Prefill side, on a GPU: a writer lane whose front write's layer the
    /// GPU has not written, with nothing else ready, parks and keeps taking
    /// writes (`true`); `false`: it waits for that layer on its thread, as
    /// before 2026-12-05, and writes handed to it meanwhile wait too (kept
    /// for A/B runs: `orbitkv.pd.gpu_wait` `block`).
    pub lanes_park_on_gpu: bool,
    /// Prefill side, requests staged by layer: a request one of whose
    /// layers finds no room in the source staging region gives back every
    /// piece no write has taken yet and takes no more (`true`), so the
    /// room goes to requests it can stage whole, whose pages may go back
    /// before their writes; `false` (the default): that layer alone is
    /// written from the pages and the request keeps its other pieces
    /// (`orbitkv.pd.staging_pieces` `request` / `layer`).
    pub pieces_whole_requests: bool,
    /// Prefill side, with a source staging region: a writer lane gathers a
    /// layer write whose sources are scattered into one piece of the region
    /// once the layer is computed, and writes the piece
    /// (`orbitkv.pd.staging_pieces` `write`; [`super::prefill::gather`]),
    /// from the moment the worker says how to copy
    /// (`Runtime::set_writer_gather`). Requests then open without staging
    /// of their own.
    pub gather_in_writer: bool,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            consumer_timeout: Duration::from_secs(120),
            quarantine: Duration::from_secs(60),
            handshake_timeout: Duration::from_secs(120),
            write_timeout: Duration::from_secs(30),
            max_bytes_in_flight_per_peer: 1 << 30,
            max_ranges_in_flight_per_peer: None,
            writer_lanes_per_peer: 4,
            peer_idle_reclaim: Duration::from_secs(60),
            inline_submit_max_ranges: 64,
            notify_poll: Duration::from_micros(250),
            max_parked: 4096,
            max_parked_bytes: 64 << 20,
            max_parked_per_source: None,
            max_parked_bytes_per_source: None,
            side_channel_key: None,
            publish_timeout: Duration::from_secs(10),
            staging_region: None,
            source_staging_region: None,
            source_staging_later: false,
            staging_min_ranges: 16,
            lanes_park_on_gpu: true,
            pieces_whole_requests: false,
            gather_in_writer: false,
        }
    }
}

impl RuntimeConfig {
    /// The entries one source may hold before its request opens: the
    /// setting, else a quarter of `max_parked` (at least 1), at most
    /// `max_parked`.
    pub fn parked_per_source(&self) -> usize {
        let share = self.max_parked / super::prefill::preopen::PER_SOURCE_SHARE;
        self.max_parked_per_source
            .unwrap_or(share)
            .clamp(1, self.max_parked.max(1))
    }

    /// The bytes one source may hold before its request opens: the setting,
    /// else a quarter of `max_parked_bytes` (at least 1), at most
    /// `max_parked_bytes`.
    pub fn parked_bytes_per_source(&self) -> usize {
        let share = self.max_parked_bytes / super::prefill::preopen::PER_SOURCE_SHARE;
        self.max_parked_bytes_per_source
            .unwrap_or(share)
            .clamp(1, self.max_parked_bytes.max(1))
    }
}

/// The range cap a runtime over a `kind` transport uses: the setting, else
/// the transport's default. A setting above what the transport queues per
/// peer (TCP: 1024) is kept, with a warning: its larger batches fail there.
pub(super) fn resolve_range_cap(cfg: &RuntimeConfig, kind: TransportKind) -> usize {
    let Some(n) = cfg.max_ranges_in_flight_per_peer else {
        return kind.default_ranges_in_flight();
    };
    if let Some(limit) = kind.queue_limit().filter(|&l| n > l) {
        tracing::warn!(max_ranges_in_flight_per_peer = n, transport = %kind, limit,
            "more ranges in flight per peer than Mooncake's transport queues per peer: \
             writes beyond its limit fail (raise MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER or lower \
             orbitkv.pd.max_inflight_ranges)");
    }
    n
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
    if cfg.source_staging_later && cfg.source_staging_region.is_some() {
        return Err(invalid_argument(
            "source_staging_later and source_staging_region: one source staging, not both".into(),
        ));
    }
    if let (Some(a), Some(b)) = (cfg.staging_region, cfg.source_staging_region) {
        if overlaps(a, b) {
            return Err(invalid_argument(
                "staging_region and source_staging_region overlap".into(),
            ));
        }
    }
    Ok(())
}

/// Whether two `(address, bytes)` ranges share a byte.
pub(super) fn overlaps((a, al): (u64, u64), (b, bl): (u64, u64)) -> bool {
    a < b.saturating_add(bl) && b < a.saturating_add(al)
}

/// A setting or argument out of range (raised as `InvalidArgumentError`).
pub(super) fn invalid_argument(msg: String) -> RuntimeError {
    RuntimeError::InvalidArgument(msg)
}

/// The runtime's settings as they cross a language boundary: plain numbers
/// (seconds, milliseconds, bytes, counts), each optional (`None`: the
/// default), named as the Python `Runtime(...)` keywords are. The binding
/// fills one from its keyword arguments and the core turns it into a
/// [`RuntimeConfig`] ([`Self::config`]): the checks and bounds are written
/// here, once; [`Self::defaults`] is what Python reads as
/// `RUNTIME_DEFAULTS`.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuntimeSettings {
    pub consumer_timeout_s: Option<f64>,
    pub handshake_timeout_s: Option<f64>,
    pub write_timeout_s: Option<f64>,
    pub quarantine_s: Option<f64>,
    pub max_bytes_in_flight_per_peer: Option<u64>,
    pub max_ranges_in_flight_per_peer: Option<usize>,
    pub writer_lanes_per_peer: Option<usize>,
    pub notify_poll_ms: Option<f64>,
    pub max_parked: Option<usize>,
    pub max_parked_bytes: Option<usize>,
    /// `None`: a quarter of `max_parked` (not in [`Self::defaults`]).
    pub max_parked_per_source: Option<usize>,
    /// `None`: a quarter of `max_parked_bytes` (not in [`Self::defaults`]).
    pub max_parked_bytes_per_source: Option<usize>,
    /// The deployment key (bytes; not in [`Self::defaults`]).
    #[serde(skip)]
    pub side_channel_key: Option<Vec<u8>>,
    pub publish_timeout_s: Option<f64>,
    pub staging_region: Option<(u64, u64)>,
    pub source_staging_region: Option<(u64, u64)>,
    pub source_staging_later: Option<bool>,
    pub staging_min_ranges: Option<usize>,
    pub inline_submit_max_ranges: Option<usize>,
    pub peer_idle_reclaim_s: Option<f64>,
    pub lanes_park_on_gpu: Option<bool>,
    pub pieces_whole_requests: Option<bool>,
    pub gather_in_writer: Option<bool>,
}

/// The most writer lanes per peer a setting may ask for.
const MAX_WRITER_LANES: usize = 64;

impl RuntimeSettings {
    /// Every setting with a default, at its default (the staging regions and
    /// the key have none).
    pub fn defaults() -> Self {
        let d = RuntimeConfig::default();
        Self {
            consumer_timeout_s: Some(d.consumer_timeout.as_secs_f64()),
            handshake_timeout_s: Some(d.handshake_timeout.as_secs_f64()),
            write_timeout_s: Some(d.write_timeout.as_secs_f64()),
            quarantine_s: Some(d.quarantine.as_secs_f64()),
            max_bytes_in_flight_per_peer: Some(d.max_bytes_in_flight_per_peer),
            // by transport: none written here (RUNTIME_DEFAULTS leaves it out)
            max_ranges_in_flight_per_peer: d.max_ranges_in_flight_per_peer,
            writer_lanes_per_peer: Some(d.writer_lanes_per_peer),
            notify_poll_ms: Some(d.notify_poll.as_secs_f64() * 1000.0),
            max_parked: Some(d.max_parked),
            max_parked_bytes: Some(d.max_parked_bytes),
            // a share of the above: none written here
            max_parked_per_source: d.max_parked_per_source,
            max_parked_bytes_per_source: d.max_parked_bytes_per_source,
            side_channel_key: None,
            publish_timeout_s: Some(d.publish_timeout.as_secs_f64()),
            staging_region: None,
            source_staging_region: None,
            source_staging_later: Some(d.source_staging_later),
            staging_min_ranges: Some(d.staging_min_ranges),
            inline_submit_max_ranges: Some(d.inline_submit_max_ranges),
            peer_idle_reclaim_s: Some(d.peer_idle_reclaim.as_secs_f64()),
            lanes_park_on_gpu: Some(d.lanes_park_on_gpu),
            pieces_whole_requests: Some(d.pieces_whole_requests),
            gather_in_writer: Some(d.gather_in_writer),
        }
    }

    /// The [`RuntimeConfig`] these settings give: a duration must be a
    /// finite number of seconds above 0 (`InvalidArgument` naming the
    /// setting otherwise); budgets and counts are at least 1, writer lanes
    /// at most 64. The staging regions are checked when the runtime starts.
    pub fn config(&self) -> Result<RuntimeConfig, RuntimeError> {
        let d = RuntimeConfig::default();
        let secs = |name: &str, v: Option<f64>, default: Duration| -> Result<Duration, RuntimeError> {
            let Some(s) = v else { return Ok(default) };
            if !s.is_finite() || s <= 0.0 {
                return Err(invalid_argument(format!(
                    "{name} must be a finite number > 0, not {s}"
                )));
            }
            Duration::try_from_secs_f64(s).map_err(|e| invalid_argument(format!("{name}: {e}")))
        };
        Ok(RuntimeConfig {
            consumer_timeout: secs("consumer_timeout_s", self.consumer_timeout_s, d.consumer_timeout)?,
            handshake_timeout: secs(
                "handshake_timeout_s",
                self.handshake_timeout_s,
                d.handshake_timeout,
            )?,
            write_timeout: secs("write_timeout_s", self.write_timeout_s, d.write_timeout)?,
            quarantine: secs("quarantine_s", self.quarantine_s, d.quarantine)?,
            max_bytes_in_flight_per_peer: self
                .max_bytes_in_flight_per_peer
                .unwrap_or(d.max_bytes_in_flight_per_peer)
                .max(1),
            max_ranges_in_flight_per_peer: self
                .max_ranges_in_flight_per_peer
                .or(d.max_ranges_in_flight_per_peer)
                .map(|n| n.max(1)),
            writer_lanes_per_peer: self
                .writer_lanes_per_peer
                .unwrap_or(d.writer_lanes_per_peer)
                .clamp(1, MAX_WRITER_LANES),
            peer_idle_reclaim: secs(
                "peer_idle_reclaim_s",
                self.peer_idle_reclaim_s,
                d.peer_idle_reclaim,
            )?,
            notify_poll: secs(
                "notify_poll_ms",
                self.notify_poll_ms.map(|ms| ms / 1000.0),
                d.notify_poll,
            )?,
            max_parked: self.max_parked.unwrap_or(d.max_parked).max(1),
            max_parked_bytes: self.max_parked_bytes.unwrap_or(d.max_parked_bytes).max(1),
            max_parked_per_source: self.max_parked_per_source.map(|n| n.max(1)),
            max_parked_bytes_per_source: self.max_parked_bytes_per_source.map(|n| n.max(1)),
            side_channel_key: self.side_channel_key.clone().map(Arc::new),
            publish_timeout: secs("publish_timeout_s", self.publish_timeout_s, d.publish_timeout)?,
            staging_region: self.staging_region,
            source_staging_region: self.source_staging_region,
            source_staging_later: self.source_staging_later.unwrap_or(d.source_staging_later),
            staging_min_ranges: self.staging_min_ranges.unwrap_or(d.staging_min_ranges),
            inline_submit_max_ranges: self
                .inline_submit_max_ranges
                .unwrap_or(d.inline_submit_max_ranges),
            lanes_park_on_gpu: self.lanes_park_on_gpu.unwrap_or(d.lanes_park_on_gpu),
            pieces_whole_requests: self.pieces_whole_requests.unwrap_or(d.pieces_whole_requests),
            gather_in_writer: self.gather_in_writer.unwrap_or(d.gather_in_writer),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_left_out_are_the_defaults_and_the_defaults_round_trip() {
        assert_eq!(
            RuntimeSettings::default().config().unwrap(),
            RuntimeConfig::default()
        );
        assert_eq!(
            RuntimeSettings::defaults().config().unwrap(),
            RuntimeConfig::default()
        );
    }

    #[test]
    fn a_source_staging_given_now_and_later_is_refused() {
        let both = RuntimeConfig {
            source_staging_region: Some((1 << 20, 1 << 20)),
            source_staging_later: true,
            ..Default::default()
        };
        let e = check_staging_regions(&both).unwrap_err();
        assert!(
            matches!(&e, RuntimeError::InvalidArgument(m) if m.contains("source_staging_later")),
            "{e}"
        );
        let later = RuntimeSettings {
            source_staging_later: Some(true),
            ..Default::default()
        }
        .config()
        .unwrap();
        assert!(later.source_staging_later);
        check_staging_regions(&later).unwrap();
    }

    #[test]
    fn bad_durations_name_the_setting_and_bounds_hold() {
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let s = RuntimeSettings {
                write_timeout_s: Some(bad),
                ..Default::default()
            };
            let e = s.config().unwrap_err();
            assert!(
                matches!(&e, RuntimeError::InvalidArgument(m) if m.contains("write_timeout_s")),
                "{e}"
            );
        }
        let c = RuntimeSettings {
            writer_lanes_per_peer: Some(1000),
            max_parked: Some(0),
            notify_poll_ms: Some(0.5),
            ..Default::default()
        }
        .config()
        .unwrap();
        assert_eq!((c.writer_lanes_per_peer, c.max_parked), (MAX_WRITER_LANES, 1));
        assert_eq!(c.notify_poll, Duration::from_micros(500));
    }

    #[test]
    fn a_sources_share_of_the_parking_is_a_quarter_unless_set() {
        let d = RuntimeConfig::default();
        assert_eq!(
            (d.parked_per_source(), d.parked_bytes_per_source()),
            (1024, 16 << 20)
        );
        let c = RuntimeSettings {
            max_parked: Some(64),
            ..Default::default()
        }
        .config()
        .unwrap();
        assert_eq!(c.parked_per_source(), 16);
        let c = RuntimeSettings {
            max_parked: Some(64),
            max_parked_per_source: Some(1000),
            max_parked_bytes_per_source: Some(0),
            ..Default::default()
        }
        .config()
        .unwrap();
        // at most the whole table, at least 1
        assert_eq!((c.parked_per_source(), c.parked_bytes_per_source()), (64, 1));
    }

    #[test]
    fn the_range_cap_is_the_setting_else_the_transports_default() {
        let unset = RuntimeConfig::default();
        assert_eq!(resolve_range_cap(&unset, TransportKind::NvlinkIntra), 8192);
        for k in TransportKind::ALL
            .into_iter()
            .filter(|&k| k != TransportKind::NvlinkIntra)
        {
            assert_eq!(resolve_range_cap(&unset, k), 768, "{k}");
        }
        // Set: kept on every transport (above TCP's queue, with a warning).
        for (n, k) in [
            (100, TransportKind::NvlinkIntra),
            (4096, TransportKind::Tcp),
            (1, TransportKind::Rdma),
        ] {
            let set = RuntimeConfig {
                max_ranges_in_flight_per_peer: Some(n),
                ..RuntimeConfig::default()
            };
            assert_eq!(resolve_range_cap(&set, k), n, "{k}");
        }
        // A setting of 0 becomes 1.
        let zero = RuntimeSettings {
            max_ranges_in_flight_per_peer: Some(0),
            ..Default::default()
        };
        assert_eq!(zero.config().unwrap().max_ranges_in_flight_per_peer, Some(1));
    }

    #[test]
    fn unknown_settings_are_refused() {
        let e =
            serde_json::from_str::<RuntimeSettings>(r#"{"consumer_timeout_s": 1, "typo_s": 2}"#).unwrap_err();
        assert!(e.to_string().contains("typo_s"), "{e}");
    }
}
