//! Counters the runtime keeps; the vLLM connector reports them through
//! vLLM's stats hooks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A monotonically increasing counter, on a cache line (two: adjacent-line
/// prefetch) of its own: the per-layer path on the caller's thread and the
/// writers' threads bump different counters, which must not share a line.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct Counter(AtomicU64);

impl Counter {
    pub fn inc(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    pub fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Everything counted, shared by the actors.
#[derive(Debug, Default)]
pub struct Stats {
    pub bytes_written: Counter,
    pub layers_written: Counter,
    pub writes_failed: Counter,
    pub notices_sent: Counter,
    pub notices_failed: Counter,
    pub notices_routed: Counter,
    pub notices_unknown_request: Counter,
    pub notices_stale_generation: Counter,
    pub notices_malformed: Counter,
    /// Notices dropped for a missing or wrong tag (not made by the holder
    /// of the request's capability: forged, or from a stranger).
    pub notices_unauthenticated: Counter,
    pub events_dropped: Counter,
    pub consumers_completed: Counter,
    pub consumers_failed: Counter,
    pub producers_released: Counter,
    /// Producers given up because no consumer claimed them (no handshake)
    /// by the claim deadline or within the unclaimed cap.
    pub producers_unclaimed_released: Counter,
    /// Handshakes and cancels refused for a wrong or missing capability.
    pub side_channel_forbidden: Counter,
    /// Handshakes and cancels refused because the parking budget was full.
    pub side_channel_overloaded: Counter,
    /// Parked handshakes and early cancels dropped at their deadline.
    pub parked_expired: Counter,
    /// Sum over completed consumer requests of open → complete, in µs.
    pub transfer_micros: Counter,
    /// Steps' layers handed to the layer gate and admitted.
    pub ready_items: Counter,
    /// Sum over them of handed over → admitted (the GPU's lag behind the
    /// worker's launches, plus queueing), in µs.
    pub ready_lag_micros: Counter,
    /// Write batches submitted to Mooncake.
    pub write_batches: Counter,
    /// Ranges (Mooncake transfer requests) in them.
    pub write_ranges: Counter,
    /// Layer writes that rode in a batch begun by an earlier write to the
    /// same peer (group commit).
    pub writes_grouped: Counter,
    /// Sum of the time spent inside Mooncake's submit call, in µs.
    pub write_submit_micros: Counter,
    /// Sum over batches of submitted → seen ended, in µs.
    pub write_batch_micros: Counter,
    /// Sum over layer writes of admitted by the writer → written, in µs
    /// (waiting for the per-peer budget included).
    pub layer_write_micros: Counter,
    /// Sum over layer writes of admitted by the writer → its first batch
    /// submitted, in µs: the part of `layer_write_micros` spent queued
    /// (behind the lane's batch in flight, or behind the GPU).
    pub write_queue_micros: Counter,
    /// Sum of the time writer lanes were parked on the GPU, in µs: from a
    /// lane finding the layer at the front of its queue not yet written
    /// with nothing else ready, to that layer's mark judged (a parked lane
    /// still sends what comes ready meanwhile).
    pub write_gpu_wait_micros: Counter,
    /// Group commits that passed over a queued write whose layer the GPU
    /// had not written yet (it goes in a later batch).
    pub group_stops_gpu: Counter,
    /// Layer writes sent before an earlier write queued in the same writer
    /// lane because the GPU had written their layer and not yet the earlier
    /// one's (a decode that authorized late; the lane does not wait for the
    /// GPU while it has something to send).
    pub writes_ahead_of_gpu: Counter,
    /// Group commits that stopped at a queued write that did not fit the
    /// lane's range or byte budget (it goes in a later batch).
    pub group_stops_budget: Counter,
    /// Write batches still in Mooncake at `write_timeout` (held on, not
    /// given up: their bytes may still move).
    pub writes_late: Counter,
    /// Write batches given up at `write_timeout + quarantine` while Mooncake
    /// had not ended them.
    pub writes_abandoned: Counter,
    /// Consumers whose blocks were freed by the quarantine with a producer
    /// that never ended.
    pub consumers_quarantine_expired: Counter,
    /// Decode side: producer ranks a fence ended (they answered that
    /// nothing more can be written), freeing the blocks before a notice.
    pub ranks_fenced: Counter,
    /// Decode side: cancels sent as fences (vLLM released a request whose
    /// producers had not all ended), one per producer rank asked.
    pub fences_sent: Counter,
    /// Layers the vLLM worker sent at `wait_for_save` because vLLM never
    /// called `save_kv_layer` for them (a model path without the per-layer
    /// hook): correct, but not overlapped with the forward.
    pub layers_saved_at_wait: Counter,
    /// Requests the vLLM connector served plainly (no transfer) because
    /// their `kv_transfer_params` were refused: malformed, a duplicate
    /// request ID, an undeclared prefill, a missing or wrong signature, or
    /// a P/D dialect OrbitKV does not serve (the log says which).
    pub params_refused: Counter,
    /// Decode side: requests given a staging grant.
    pub staging_granted: Counter,
    /// Decode side: requests that would have been given a staging grant but
    /// found the staging region full (written directly instead).
    pub staging_exhausted: Counter,
    /// Prefill side: layer writes that went from source staging (into a
    /// consumer's grant, or straight into its pages).
    pub layers_staged: Counter,
    /// Prefill side: of those, the ones written straight into the
    /// consumer's pages (no grant, no scatter on decode).
    pub layers_staged_to_pages: Counter,
    /// Prefill side: staged chunks the worker was told to gather in the
    /// consumer's block order (`Runtime::producer_gather_order`; the
    /// others, in the request's order, were in order already or not
    /// written into pages).
    pub chunks_reordered: Counter,
    /// Prefill side: layers of a chunk given no layer piece (staged by
    /// layer, the default), or requests the worker opened without a whole
    /// source staging (a size set by hand), because the source region had
    /// no room (written page to page; `orbitkv.pd.staging_mb`).
    pub source_staging_full: Counter,
    /// Prefill side: requests staged by layer whose pages went back to vLLM
    /// before their writes ended (every layer in a layer piece or at
    /// decode already, `Runtime::producer_give_back_pages`).
    pub producer_pages_given_back: Counter,
    /// Prefill side, `orbitkv.pd.staging_pieces` `request`: layer pieces a
    /// request gave back before any write read them, because a later layer
    /// of it found no room (its pages stay until those layers are at
    /// decode, so its pieces go to requests the region can stage whole).
    pub source_pieces_given_up: Counter,
    /// Prefill side, `staging_pieces` `write`: layer writes a lane gathered
    /// into a piece of the source region and wrote from there.
    pub writes_gathered: Counter,
    /// Ranges those writes saved (direct ranges less the piece's).
    pub gather_ranges_saved: Counter,
    /// Sum of the gathers' copy times (waited for), in µs.
    pub gather_micros: Counter,
    /// Writes that would have paid to gather but found no room (from the
    /// pages instead).
    pub gather_no_room: Counter,
    /// Gathers whose copy failed (the write went from the pages).
    pub gather_failed: Counter,
    /// Gathered pieces kept out of the region for good: a batch reading one
    /// was given up while Mooncake still held it.
    pub gather_pieces_leaked: Counter,
    /// Prefill side: layers whose `LayerReady` ran on the thread that
    /// handed them over (no message to the system thread).
    pub layers_ready_inline: Counter,
    /// Prefill side: layer writes submitted to Mooncake on that thread
    /// (their writer was idle; no message to its thread).
    pub writes_inline: Counter,
    /// Prefill side: write ends (done or failed) that the writer lane ran
    /// on its own thread into the producer's machine (the producer was
    /// idle; no message to the system thread).
    pub writes_reported_inline: Counter,
    /// Prefill side: peers whose writer lanes and segment were reclaimed
    /// after `peer_idle_reclaim` idle.
    pub peers_reclaimed: Counter,
    /// Durations of a request's phases, one per request, kept until vLLM's
    /// stats report takes them ([`Timings`]).
    pub timings: Timings,
}

/// A phase of a request whose duration is kept, one per request, for a
/// histogram (where the time after vLLM finished a prefill goes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timing {
    /// Prefill side: vLLM finished the request (every layer handed over) →
    /// its last write ended well and its `done` notice was handed to the
    /// peer's notice lane (timed before the release, so vLLM's stats report
    /// of the step that sees the release carries it). The
    /// transfer's tail after the prefill answered.
    WrittenAfterFinish,
    /// Prefill side: vLLM finished the request → its KV pages went back to
    /// vLLM (given back early, or the request released). What holds
    /// prefill KV after its answer.
    PagesHeldAfterFinish,
    /// Decode side: every producer reported done (the KV is in place) → the
    /// vLLM worker took the completion (`Runtime::poll_events`).
    CompleteToTaken,
    /// Prefill side, with [`Self::WrittenAfterFinish`] (a request written
    /// in full): vLLM finished the request → decode's handshake (its
    /// authorization) reached the producer; 0 when it came before the
    /// finish (the streaming flow's usual order).
    HandshakeAfterFinish,
    /// Prefill side, with [`Self::WrittenAfterFinish`]: vLLM finished the
    /// request → the lane of its last-computed write saw the GPU had
    /// computed that layer (its mark reached; a lane busy with earlier
    /// batches sees it late); 0 when every layer was computed before the
    /// finish. Under vLLM's async scheduling the finish comes when the last
    /// step was *launched*, so this is the GPU's lag behind the launches.
    ComputedAfterFinish,
    /// Prefill side, with [`Self::WrittenAfterFinish`]: vLLM finished the
    /// request → its last write's first batch went to Mooncake (the lane
    /// had seen the GPU reach its layer); 0 when every write was sent
    /// before the finish. Written minus this is the last batch's flight.
    SentAfterFinish,
}

impl Timing {
    pub const ALL: [Timing; 6] = [
        Timing::WrittenAfterFinish,
        Timing::PagesHeldAfterFinish,
        Timing::CompleteToTaken,
        Timing::HandshakeAfterFinish,
        Timing::SentAfterFinish,
        Timing::ComputedAfterFinish,
    ];

    /// The name the binding and the metrics use.
    pub fn name(self) -> &'static str {
        match self {
            Timing::WrittenAfterFinish => "written_after_finish",
            Timing::PagesHeldAfterFinish => "pages_held_after_finish",
            Timing::CompleteToTaken => "complete_to_taken",
            Timing::HandshakeAfterFinish => "handshake_after_finish",
            Timing::SentAfterFinish => "sent_after_finish",
            Timing::ComputedAfterFinish => "computed_after_finish",
        }
    }
}

/// Durations kept per [`Timing`] until taken ([`Timings::take`]); at most
/// [`TIMINGS_KEPT`] of each between two takes (vLLM's stats report takes
/// them every engine step), the rest counted in [`Timings::dropped`] and
/// not kept: the runtime never grows without bound when nobody takes them.
#[derive(Debug, Default)]
pub struct Timings {
    kept: parking_lot::Mutex<[Vec<u32>; Timing::ALL.len()]>,
    dropped: Counter,
}

/// Durations of one [`Timing`] kept between two takes.
pub const TIMINGS_KEPT: usize = 4096;

impl Timings {
    /// Keeps `d` (in µs, at most `u32::MAX`: 71 minutes) for `what`.
    pub fn observe(&self, what: Timing, d: Duration) {
        let micros = u32::try_from(d.as_micros()).unwrap_or(u32::MAX);
        let mut kept = self.kept.lock();
        let list = &mut kept[what as usize];
        if list.len() < TIMINGS_KEPT {
            list.push(micros);
        } else {
            self.dropped.inc();
        }
    }

    /// Takes every duration kept since the last take, in µs, per timing.
    pub fn take(&self) -> Vec<(Timing, Vec<u32>)> {
        let mut kept = self.kept.lock();
        Timing::ALL
            .iter()
            .map(|&t| (t, std::mem::take(&mut kept[t as usize])))
            .collect()
    }

    /// Durations not kept because [`TIMINGS_KEPT`] were waiting to be taken.
    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }
}

/// A point-in-time copy of [`Stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct StatsSnapshot {
    pub bytes_written: u64,
    pub layers_written: u64,
    pub writes_failed: u64,
    pub notices_sent: u64,
    pub notices_failed: u64,
    pub notices_routed: u64,
    pub notices_unknown_request: u64,
    pub notices_stale_generation: u64,
    pub notices_malformed: u64,
    pub notices_unauthenticated: u64,
    pub events_dropped: u64,
    pub consumers_completed: u64,
    pub consumers_failed: u64,
    pub producers_released: u64,
    pub producers_unclaimed_released: u64,
    pub side_channel_forbidden: u64,
    pub side_channel_overloaded: u64,
    pub parked_expired: u64,
    pub transfer_micros: u64,
    pub ready_items: u64,
    pub ready_lag_micros: u64,
    pub write_batches: u64,
    pub write_ranges: u64,
    pub writes_grouped: u64,
    pub write_submit_micros: u64,
    pub write_batch_micros: u64,
    pub layer_write_micros: u64,
    pub write_queue_micros: u64,
    pub write_gpu_wait_micros: u64,
    pub group_stops_gpu: u64,
    pub writes_ahead_of_gpu: u64,
    pub group_stops_budget: u64,
    pub writes_late: u64,
    pub writes_abandoned: u64,
    pub consumers_quarantine_expired: u64,
    pub ranks_fenced: u64,
    pub fences_sent: u64,
    pub layers_saved_at_wait: u64,
    pub params_refused: u64,
    pub staging_granted: u64,
    pub staging_exhausted: u64,
    pub layers_staged: u64,
    pub layers_staged_to_pages: u64,
    pub chunks_reordered: u64,
    pub source_staging_full: u64,
    pub producer_pages_given_back: u64,
    pub source_pieces_given_up: u64,
    pub writes_gathered: u64,
    pub gather_ranges_saved: u64,
    pub gather_micros: u64,
    pub gather_no_room: u64,
    pub gather_failed: u64,
    pub gather_pieces_leaked: u64,
    pub layers_ready_inline: u64,
    pub writes_inline: u64,
    pub writes_reported_inline: u64,
    pub peers_reclaimed: u64,
    /// Phase durations not kept because [`TIMINGS_KEPT`] of their kind were
    /// waiting to be taken ([`Timings`]).
    pub timings_dropped: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            bytes_written: self.bytes_written.get(),
            layers_written: self.layers_written.get(),
            writes_failed: self.writes_failed.get(),
            notices_sent: self.notices_sent.get(),
            notices_failed: self.notices_failed.get(),
            notices_routed: self.notices_routed.get(),
            notices_unknown_request: self.notices_unknown_request.get(),
            notices_stale_generation: self.notices_stale_generation.get(),
            notices_malformed: self.notices_malformed.get(),
            notices_unauthenticated: self.notices_unauthenticated.get(),
            events_dropped: self.events_dropped.get(),
            consumers_completed: self.consumers_completed.get(),
            consumers_failed: self.consumers_failed.get(),
            producers_released: self.producers_released.get(),
            producers_unclaimed_released: self.producers_unclaimed_released.get(),
            side_channel_forbidden: self.side_channel_forbidden.get(),
            side_channel_overloaded: self.side_channel_overloaded.get(),
            parked_expired: self.parked_expired.get(),
            transfer_micros: self.transfer_micros.get(),
            ready_items: self.ready_items.get(),
            ready_lag_micros: self.ready_lag_micros.get(),
            write_batches: self.write_batches.get(),
            write_ranges: self.write_ranges.get(),
            writes_grouped: self.writes_grouped.get(),
            write_submit_micros: self.write_submit_micros.get(),
            write_batch_micros: self.write_batch_micros.get(),
            layer_write_micros: self.layer_write_micros.get(),
            write_queue_micros: self.write_queue_micros.get(),
            write_gpu_wait_micros: self.write_gpu_wait_micros.get(),
            group_stops_gpu: self.group_stops_gpu.get(),
            writes_ahead_of_gpu: self.writes_ahead_of_gpu.get(),
            group_stops_budget: self.group_stops_budget.get(),
            writes_late: self.writes_late.get(),
            writes_abandoned: self.writes_abandoned.get(),
            consumers_quarantine_expired: self.consumers_quarantine_expired.get(),
            ranks_fenced: self.ranks_fenced.get(),
            fences_sent: self.fences_sent.get(),
            layers_saved_at_wait: self.layers_saved_at_wait.get(),
            params_refused: self.params_refused.get(),
            staging_granted: self.staging_granted.get(),
            staging_exhausted: self.staging_exhausted.get(),
            layers_staged: self.layers_staged.get(),
            layers_staged_to_pages: self.layers_staged_to_pages.get(),
            chunks_reordered: self.chunks_reordered.get(),
            source_staging_full: self.source_staging_full.get(),
            producer_pages_given_back: self.producer_pages_given_back.get(),
            source_pieces_given_up: self.source_pieces_given_up.get(),
            writes_gathered: self.writes_gathered.get(),
            gather_ranges_saved: self.gather_ranges_saved.get(),
            gather_micros: self.gather_micros.get(),
            gather_no_room: self.gather_no_room.get(),
            gather_failed: self.gather_failed.get(),
            gather_pieces_leaked: self.gather_pieces_leaked.get(),
            layers_ready_inline: self.layers_ready_inline.get(),
            writes_inline: self.writes_inline.get(),
            writes_reported_inline: self.writes_reported_inline.get(),
            peers_reclaimed: self.peers_reclaimed.get(),
            timings_dropped: self.timings.dropped(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_are_kept_until_taken_and_bounded_meanwhile() {
        let t = Timings::default();
        t.observe(Timing::WrittenAfterFinish, Duration::from_millis(3));
        t.observe(Timing::CompleteToTaken, Duration::from_secs(5000));
        let taken = t.take();
        assert_eq!(taken.len(), Timing::ALL.len());
        let of = |taken: &[(Timing, Vec<u32>)], w: Timing| {
            taken
                .iter()
                .find(|(x, _)| *x == w)
                .map(|(_, v)| v.clone())
                .unwrap()
        };
        assert_eq!(of(&taken, Timing::WrittenAfterFinish), vec![3000]);
        assert_eq!(of(&taken, Timing::PagesHeldAfterFinish), Vec::<u32>::new());
        // clipped at u32::MAX µs, not wrapped
        assert_eq!(of(&taken, Timing::CompleteToTaken), vec![u32::MAX]);
        // taken once
        assert!(t.take().iter().all(|(_, v)| v.is_empty()));
        for _ in 0..TIMINGS_KEPT + 5 {
            t.observe(Timing::PagesHeldAfterFinish, Duration::from_micros(1));
        }
        assert_eq!(of(&t.take(), Timing::PagesHeldAfterFinish).len(), TIMINGS_KEPT);
        assert_eq!(t.dropped(), 5);
        // what was dropped is a counter of the snapshot
        let stats = Stats::default();
        for _ in 0..=TIMINGS_KEPT {
            stats
                .timings
                .observe(Timing::CompleteToTaken, Duration::from_micros(1));
        }
        assert_eq!(stats.snapshot().timings_dropped, 1);
        let names: std::collections::HashSet<_> = Timing::ALL.iter().map(|t| t.name()).collect();
        assert_eq!(names.len(), Timing::ALL.len());
    }
}
