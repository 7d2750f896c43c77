//! The writer's gather (`orbitkv.pd.staging_pieces` `write`,
//! [`crate::actors::RuntimeConfig::gather_in_writer`]): a writer lane about
//! to submit a layer write whose source ranges are scattered over prefill's
//! pages copies them, in the order of their destinations, into one piece of
//! the source staging region, and writes the piece instead: one range per
//! run of consecutive destination bytes, whatever the prefill's pages look
//! like. The piece is taken only once the layer is computed (the lane
//! judged its GPU mark) and goes back when the write ended, so the region
//! holds the writes in flight, not the GPU's lag behind the worker.
//!
//! What it changes and what it does not:
//! * the destination of every byte is the one the producer planned (inside
//!   the authorized blocks, checked at planning); only where Mooncake reads
//!   it from changes, so nothing a peer sends steers the gather;
//! * it reads exactly the source bytes the direct write would have read,
//!   from pages the producer holds until the write ended, so it needs no
//!   rule of its own about when prefill's pages may go back;
//! * a write that would not save ranges, a region without room, or a copy
//!   that fails is written from the pages, as without the gather.

use std::sync::Arc;
use std::time::Instant;

use crate::actors::stats::Stats;
use crate::staging::SharedArena;
use crate::transport::cuda::CudaCopier;
use crate::transport::WriteRange;

/// A write is gathered only when that saves at least this many ranges.
pub const MIN_RANGES_SAVED: usize = 8;

/// How the lane copies the source bytes into the piece.
pub enum LocalCopy {
    /// Not set up yet: no write is gathered (the worker says how, once its
    /// KV cache is registered: [`WriterGather::set_copy`]).
    Off,
    /// The KV cache is host memory: `memcpy` on the lane's thread.
    Host,
    /// The KV cache is on a GPU: device copies, waited for.
    Cuda(CudaCopier),
}

/// What every writer lane of a runtime shares for the gather.
pub struct WriterGather {
    arena: SharedArena,
    copy: parking_lot::RwLock<LocalCopy>,
    stats: Arc<Stats>,
}

/// A write planned through a piece: the copies into it, the ranges to
/// write (those of `from_piece` read the piece: offsets from its start
/// until [`Bounce::at`]; the others read the pages as planned), the bytes
/// the piece holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bounce {
    pub gather: Vec<WriteRange>,
    pub write: Vec<WriteRange>,
    pub from_piece: Vec<bool>,
    pub bytes: u64,
}

impl Bounce {
    /// The plan for `ranges` through a piece at offset 0. The ranges are
    /// taken in the order of their destinations and cut into runs of
    /// consecutive destination bytes; a run of several ranges (its sources
    /// apart: the producer merged those that were not) is laid out in the
    /// piece one range after another and written as one range from there;
    /// a range alone in its run is written from the pages as planned (a
    /// copy would save nothing: a partial block's rows, a stray block).
    /// Copies are merged where both sides run on. `None` on an overflow.
    pub fn plan(ranges: &[WriteRange]) -> Option<Self> {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&i| ranges[i].dst);
        let (mut gather, mut write, mut from_piece) = (Vec::new(), Vec::new(), Vec::new());
        let mut off: u64 = 0;
        let mut i = 0;
        while i < order.len() {
            // the run of consecutive destinations from order[i]
            let mut j = i + 1;
            let mut end = ranges[order[i]].dst.checked_add(ranges[order[i]].len)?;
            while j < order.len() && ranges[order[j]].dst == end {
                end = end.checked_add(ranges[order[j]].len)?;
                j += 1;
            }
            if j - i == 1 {
                write.push(ranges[order[i]]);
                from_piece.push(false);
            } else {
                let first = ranges[order[i]].dst;
                let at = off;
                for &k in &order[i..j] {
                    let r = ranges[k];
                    push_merged(
                        &mut gather,
                        WriteRange {
                            src: r.src,
                            dst: off,
                            len: r.len,
                        },
                    );
                    off = off.checked_add(r.len)?;
                }
                write.push(WriteRange {
                    src: at,
                    dst: first,
                    len: end - first,
                });
                from_piece.push(true);
            }
            i = j;
        }
        Some(Self {
            gather,
            write,
            from_piece,
            bytes: off,
        })
    }

    /// The plan with the piece at `base`; `None` on an overflow.
    pub fn at(mut self, base: u64) -> Option<Self> {
        base.checked_add(self.bytes)?;
        for r in &mut self.gather {
            r.dst += base;
        }
        for (r, &p) in self.write.iter_mut().zip(&self.from_piece) {
            if p {
                r.src += base;
            }
        }
        Some(self)
    }

    /// Whether writing through the piece pays for the copy: it saves at
    /// least [`MIN_RANGES_SAVED`] of the `direct` ranges.
    pub fn pays(&self, direct: usize) -> bool {
        self.bytes > 0 && direct >= self.write.len() + MIN_RANGES_SAVED
    }
}

fn push_merged(v: &mut Vec<WriteRange>, r: WriteRange) {
    if let Some(l) = v.last_mut() {
        if l.src.checked_add(l.len) == Some(r.src) && l.dst.checked_add(l.len) == Some(r.dst) {
            l.len += r.len;
            return;
        }
    }
    v.push(r);
}

impl WriterGather {
    /// Gathers into pieces of `arena`; no write is gathered until
    /// [`Self::set_copy`] says how.
    pub fn new(arena: SharedArena, stats: Arc<Stats>) -> Self {
        Self {
            arena,
            copy: parking_lot::RwLock::new(LocalCopy::Off),
            stats,
        }
    }

    /// How the lanes copy from now on. The local KV layout's addresses and
    /// the region's must be memory of this process of that kind (host
    /// memory for [`LocalCopy::Host`], the copier's GPU for
    /// [`LocalCopy::Cuda`]): they are what the rank registered with
    /// Mooncake.
    pub fn set_copy(&self, copy: LocalCopy) {
        *self.copy.write() = copy;
    }

    /// Whether writes are gathered (the copy is set).
    pub fn on(&self) -> bool {
        !matches!(*self.copy.read(), LocalCopy::Off)
    }

    /// Gathers `ranges` (a layer write whose layer is computed; its source
    /// bytes held by the producer until the write ended) into a piece, when
    /// that pays and the region has room: the piece's base and the ranges
    /// to write from it. `None`: write `ranges` as they are.
    pub fn gather(&self, ranges: &[WriteRange]) -> Option<(u64, Vec<WriteRange>)> {
        if ranges.len() < MIN_RANGES_SAVED {
            return None;
        }
        let copy = self.copy.read();
        if matches!(*copy, LocalCopy::Off) {
            return None;
        }
        let plan = Bounce::plan(ranges)?;
        if !plan.pays(ranges.len()) {
            return None;
        }
        let Ok(base) = self.arena.lock().alloc(plan.bytes) else {
            self.stats.gather_no_room.inc();
            return None;
        };
        let Some(plan) = plan.at(base) else {
            self.free(base, false);
            return None;
        };
        let t = Instant::now();
        let copied = match &*copy {
            LocalCopy::Off => unreachable!("checked above"),
            LocalCopy::Host => {
                for r in &plan.gather {
                    // SAFETY: `src` lies in the rank's KV cache (host memory
                    // it registered; the range was planned inside its layout
                    // and the request's source blocks, which the producer
                    // holds until this write ended), `dst` in the piece just
                    // taken from the region (host memory nothing else touches
                    // until it is freed); the two never overlap (the region
                    // is apart from the KV pages in use).
                    unsafe {
                        std::ptr::copy_nonoverlapping(r.src as *const u8, r.dst as *mut u8, r.len as usize)
                    };
                }
                Ok(())
            }
            LocalCopy::Cuda(c) => c.copy(&plan.gather),
        };
        self.stats.gather_micros.add(t.elapsed().as_micros() as u64);
        if let Err(e) = copied {
            self.free(base, false);
            self.stats.gather_failed.inc();
            tracing::warn!(error = %e, "the writer's gather failed: the write goes from the pages");
            return None;
        }
        self.stats.writes_gathered.inc();
        self.stats
            .gather_ranges_saved
            .add((ranges.len() - plan.write.len()) as u64);
        Some((base, plan.write))
    }

    /// The write from piece `base` ended. `abandoned`: a batch of it was
    /// given up while Mooncake may still read it: the piece is never
    /// reused (counted; the region is that much smaller until restart).
    pub fn free(&self, base: u64, abandoned: bool) {
        if abandoned {
            self.stats.gather_pieces_leaked.inc();
            tracing::error!(
                base,
                "a gathered piece Mooncake may still read is kept out of the region for good"
            );
            return;
        }
        if let Err(e) = self.arena.lock().free(base) {
            tracing::error!(error = %e, "a gathered piece was not in use");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(src: u64, dst: u64, len: u64) -> WriteRange {
        WriteRange { src, dst, len }
    }

    /// Scattered sources into two runs of destinations and a range alone:
    /// each run one write from the piece, the range alone from the pages,
    /// the copies merged only where both sides run on, every byte's source
    /// kept.
    #[test]
    fn a_plan_writes_one_range_per_run_of_destinations_and_keeps_every_byte() {
        // destinations 0..4 ×100 and 10..12 ×100, sources shuffled; 50..51 alone
        let ranges = [
            r(9000, 1100, 100),
            r(5000, 0, 100),
            r(4400, 5000, 100),
            r(5100, 100, 100),
            r(7000, 300, 100),
            r(1000, 200, 100),
            r(2000, 1000, 100),
        ];
        let p = Bounce::plan(&ranges).unwrap().at(1 << 20).unwrap();
        assert_eq!(p.bytes, 600);
        assert_eq!(
            p.write,
            vec![
                r(1 << 20, 0, 400),
                r((1 << 20) + 400, 1000, 200),
                r(4400, 5000, 100)
            ]
        );
        assert_eq!(p.from_piece, vec![true, true, false]);
        assert_eq!(
            p.gather,
            vec![
                r(5000, 1 << 20, 200),
                r(1000, (1 << 20) + 200, 100),
                r(7000, (1 << 20) + 300, 100),
                r(2000, (1 << 20) + 400, 100),
                r(9000, (1 << 20) + 500, 100),
            ]
        );
        // every destination byte comes from the source byte the direct
        // write would have read
        for d in ranges {
            for k in [0, d.len - 1] {
                let (w, &piece) = p
                    .write
                    .iter()
                    .zip(&p.from_piece)
                    .find(|(w, _)| w.dst <= d.dst + k && d.dst + k < w.dst + w.len)
                    .unwrap();
                let at = w.src + (d.dst + k - w.dst);
                let src = if piece {
                    let g = p
                        .gather
                        .iter()
                        .find(|g| g.dst <= at && at < g.dst + g.len)
                        .unwrap();
                    g.src + (at - g.dst)
                } else {
                    at
                };
                assert_eq!(src, d.src + k);
            }
        }
    }

    #[test]
    fn a_plan_pays_only_when_it_saves_enough_ranges() {
        let scattered: Vec<_> = (0..16).map(|i| r(10_000 * (16 - i), 64 * i, 64)).collect();
        let p = Bounce::plan(&scattered).unwrap();
        assert_eq!(p.write.len(), 1);
        assert!(p.pays(16));
        // already one range per destination run: nothing to copy or save
        let runs: Vec<_> = (0..16).map(|i| r(10_000 * i, 1000 * i, 64)).collect();
        let p = Bounce::plan(&runs).unwrap();
        assert_eq!((p.bytes, p.write.len()), (0, 16));
        assert!(!p.pays(16));
        // saves 7 of 8: below the floor
        let few: Vec<_> = (0..8).map(|i| r(10_000 * (8 - i), 64 * i, 64)).collect();
        assert!(!Bounce::plan(&few).unwrap().pays(8));
        // a run of 9 beside 100 ranges alone (a partial block's rows): the
        // run is copied and saves 8, the others stay
        let mut mixed: Vec<_> = (0..9).map(|i| r(10_000 * (9 - i), 64 * i, 64)).collect();
        mixed.extend((0..100).map(|i| r(1 << 30 | (i * 128), 1 << 20 | (i * 128), 64)));
        let p = Bounce::plan(&mixed).unwrap();
        assert_eq!((p.bytes, p.write.len()), (9 * 64, 101));
        assert!(p.pays(mixed.len()));
        assert!(Bounce::plan(&[r(0, u64::MAX - 1, 8), r(8, 0, u64::MAX)]).is_none());
        assert!(Bounce::plan(&scattered).unwrap().at(u64::MAX - 10).is_none());
    }

    fn arena(base: u64, len: u64) -> SharedArena {
        Arc::new(parking_lot::Mutex::new(
            crate::staging::arena::StagingArena::new(base, len).unwrap(),
        ))
    }

    /// Host memory through the gather: the piece holds the sources in the
    /// order of the destinations, the writes name it, and the piece goes
    /// back once freed; a region without room, or no copy set, gathers
    /// nothing.
    #[test]
    fn a_host_gather_copies_the_sources_in_destination_order_and_gives_the_piece_back() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        // room for three pieces of 2 KiB, from an aligned address
        let region = vec![0u8; 3 * 2048 + 512];
        let base = (region.as_ptr() as u64 + 255) & !255;
        let stats = Arc::new(Stats::default());
        let g = WriterGather::new(arena(base, 3 * 2048 + 100), stats.clone());
        // 32 ranges of 64 bytes, sources reversed, destinations consecutive
        let ranges: Vec<_> = (0..32u64)
            .map(|i| r(src.as_ptr() as u64 + (31 - i) * 128, 1 << 40 | (i * 64), 64))
            .collect();
        assert!(g.gather(&ranges).is_none(), "no copy set: nothing gathered");
        g.set_copy(LocalCopy::Host);
        let (at, write) = g.gather(&ranges).unwrap();
        assert_eq!(write, vec![r(at, 1 << 40, 32 * 64)]);
        let piece = &region[(at - region.as_ptr() as u64) as usize..][..32 * 64];
        for i in 0..32usize {
            assert_eq!(&piece[i * 64..][..64], &src[(31 - i) * 128..][..64]);
        }
        assert_eq!(stats.writes_gathered.get(), 1);
        assert_eq!(stats.gather_ranges_saved.get(), 31);
        // the fourth finds no room and is written from the pages
        let (at2, _) = g.gather(&ranges).unwrap();
        let (at3, _) = g.gather(&ranges).unwrap();
        assert!(g.gather(&ranges).is_none());
        assert_eq!(stats.gather_no_room.get(), 1);
        for a in [at, at2, at3] {
            g.free(a, false);
        }
        assert_eq!(crate::staging::in_use(Some(&g.arena)), (0, 0));
        // a piece Mooncake may still read is never handed out again
        let (at4, _) = g.gather(&ranges).unwrap();
        g.free(at4, true);
        assert_eq!(stats.gather_pieces_leaked.get(), 1);
        assert_eq!(crate::staging::in_use(Some(&g.arena)).1, 1);
    }
}
