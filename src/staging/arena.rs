//! A first-fit allocator over a registered staging region of one or more
//! segments. It hands out disjoint, aligned pieces, each inside one
//! segment, and takes each back exactly once; what it holds is the only
//! record of which staging bytes are in use, so two live requests can never
//! be given overlapping memory.
//!
//! A region of several segments is what the prefill's source staging is
//! when it comes out of vLLM's KV cache (`orbitkv.pd.staging_memory`
//! `kv_cache`): the blocks the scheduler took from vLLM's pool are a stripe
//! of each layer tensor (and plane), not one address range, and a piece
//! must lie inside one of them even where two stripes happen to touch.

use std::collections::{BTreeMap, BTreeSet};

/// Alignment of every piece (bytes): wide enough for any element type and
/// for device copies that use vector loads.
pub const ALIGN: u64 = 256;

/// Why an allocation or a free was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArenaError {
    #[error("the staging region has no free piece of {wanted} bytes ({free} bytes free in all)")]
    Full { wanted: u64, free: u64 },
    #[error("{0:#x} is not the start of a piece in use")]
    NotInUse(u64),
    #[error(
        "a staging region of {len} bytes at {base:#x} is at 0, overflows or holds no 256-byte aligned byte"
    )]
    BadRegion { base: u64, len: u64 },
    #[error("a staging segment of {len} bytes at {base:#x} overlaps one the region has")]
    Overlap { base: u64, len: u64 },
}

/// Pieces of `[base, base + len)`, or of several such segments.
#[derive(Debug, Clone, Default)]
pub struct StagingArena {
    /// The segments as given, start → end.
    segments: BTreeMap<u64, u64>,
    /// Each segment's first aligned address: free pieces never merge
    /// across one, so no piece spans two segments.
    starts: BTreeSet<u64>,
    /// Free pieces, start → length; adjacent ones of one segment are
    /// always merged.
    free: BTreeMap<u64, u64>,
    /// Pieces in use, start → length.
    used: BTreeMap<u64, u64>,
}

impl StagingArena {
    /// An arena over `len` bytes at `base` (the first aligned address on).
    pub fn new(base: u64, len: u64) -> Result<Self, ArenaError> {
        let mut a = Self::default();
        a.add_segment(base, len)?;
        Ok(a)
    }

    /// An arena of no segment yet: every allocation is refused until
    /// [`Self::add_segment`] gives it one.
    pub fn empty() -> Self {
        Self::default()
    }

    /// Adds `len` bytes at `base` (the first aligned address on) as a
    /// segment of its own. Refused, with nothing changed, when it is empty,
    /// at 0, overflows, holds no aligned byte, or overlaps a segment the
    /// arena has.
    pub fn add_segment(&mut self, base: u64, len: u64) -> Result<(), ArenaError> {
        let end = base.checked_add(len).ok_or(ArenaError::BadRegion { base, len })?;
        let start = base
            .checked_add(ALIGN - 1)
            .map(|b| b / ALIGN * ALIGN)
            .filter(|&s| s < end && base != 0)
            .ok_or(ArenaError::BadRegion { base, len })?;
        let before = self.segments.range(..end).next_back();
        if before.is_some_and(|(_, &e)| e > base) {
            return Err(ArenaError::Overlap { base, len });
        }
        self.segments.insert(base, end);
        self.starts.insert(start);
        self.free.insert(start, end - start);
        Ok(())
    }

    /// The first segment: `(base, len)` (`(0, 0)` with none).
    pub fn region(&self) -> (u64, u64) {
        self.segments.iter().next().map_or((0, 0), |(&b, &e)| (b, e - b))
    }

    /// Segments and their bytes in all.
    pub fn segments(&self) -> (usize, u64) {
        (
            self.segments.len(),
            self.segments.iter().map(|(b, e)| e - b).sum(),
        )
    }

    /// Whether `[addr, addr + len)` lies inside one segment.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.segments
            .range(..=addr)
            .next_back()
            .is_some_and(|(_, &e)| end <= e)
    }

    /// A piece of at least `len` bytes (rounded up to [`ALIGN`]), the lowest
    /// that fits.
    pub fn alloc(&mut self, len: u64) -> Result<u64, ArenaError> {
        let want = len.max(1).checked_add(ALIGN - 1).map(|l| l / ALIGN * ALIGN);
        let full = || ArenaError::Full {
            wanted: len,
            free: self.free_bytes(),
        };
        let want = want.ok_or_else(full)?;
        let (&at, &have) = self.free.iter().find(|(_, &l)| l >= want).ok_or_else(full)?;
        self.free.remove(&at);
        if have > want {
            self.free.insert(at + want, have - want);
        }
        self.used.insert(at, want);
        Ok(at)
    }

    /// Gives piece `at` back.
    pub fn free(&mut self, at: u64) -> Result<(), ArenaError> {
        let len = self.used.remove(&at).ok_or(ArenaError::NotInUse(at))?;
        let (mut start, mut end) = (at, at + len);
        // Merged with its free neighbours of the same segment only.
        if let Some((&s, &l)) = self.free.range(..at).next_back() {
            if s + l == at && !self.starts.contains(&at) {
                self.free.remove(&s);
                start = s;
            }
        }
        if !self.starts.contains(&end) {
            if let Some(l) = self.free.remove(&end) {
                end += l;
            }
        }
        self.free.insert(start, end - start);
        Ok(())
    }

    /// Bytes in use (rounded pieces).
    pub fn used_bytes(&self) -> u64 {
        self.used.values().sum()
    }

    /// Pieces in use.
    pub fn pieces(&self) -> usize {
        self.used.len()
    }

    fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_are_disjoint_aligned_and_merge_back() {
        let mut a = StagingArena::new(0x1000 + 8, 64 * ALIGN).unwrap();
        let x = a.alloc(1).unwrap();
        let y = a.alloc(ALIGN + 1).unwrap();
        let z = a.alloc(3 * ALIGN).unwrap();
        assert_eq!(x % ALIGN, 0);
        assert!(x + ALIGN <= y && y + 2 * ALIGN <= z);
        assert!(a.contains(z, 3 * ALIGN));
        assert_eq!(a.used_bytes(), 6 * ALIGN);
        a.free(y).unwrap();
        // the hole is reused, first fit
        assert_eq!(a.alloc(ALIGN).unwrap(), y);
        a.free(x).unwrap();
        a.free(y).unwrap();
        a.free(z).unwrap();
        assert_eq!((a.used_bytes(), a.pieces()), (0, 0));
        // everything merged again: the whole aligned region fits once more
        let all = a.alloc(63 * ALIGN).unwrap();
        assert_eq!(all, x);
    }

    #[test]
    fn a_piece_is_freed_once_and_only_pieces_are_freed() {
        let mut a = StagingArena::new(ALIGN, 8 * ALIGN).unwrap();
        let x = a.alloc(ALIGN).unwrap();
        assert_eq!(a.free(x + 1), Err(ArenaError::NotInUse(x + 1)));
        a.free(x).unwrap();
        assert_eq!(a.free(x), Err(ArenaError::NotInUse(x)));
    }

    #[test]
    fn full_and_bad_regions_are_errors() {
        let mut a = StagingArena::new(ALIGN, 4 * ALIGN).unwrap();
        assert!(matches!(a.alloc(5 * ALIGN), Err(ArenaError::Full { .. })));
        assert!(matches!(a.alloc(u64::MAX), Err(ArenaError::Full { .. })));
        a.alloc(4 * ALIGN).unwrap();
        assert!(matches!(a.alloc(1), Err(ArenaError::Full { .. })));
        assert!(StagingArena::new(0, 1 << 20).is_err());
        assert!(StagingArena::new(u64::MAX - 4, 8).is_err());
        assert!(StagingArena::new(ALIGN + 1, 10).is_err());
    }

    #[test]
    fn pieces_stay_inside_one_segment_even_where_segments_touch() {
        // Two touching segments of 4 units and one apart of 2; none empty.
        let mut a = StagingArena::empty();
        assert!(matches!(a.alloc(1), Err(ArenaError::Full { .. })));
        a.add_segment(4 * ALIGN, 4 * ALIGN).unwrap();
        a.add_segment(8 * ALIGN, 4 * ALIGN).unwrap();
        a.add_segment(64 * ALIGN, 2 * ALIGN).unwrap();
        assert_eq!(a.segments(), (3, 10 * ALIGN));
        // 8 units are free side by side, but no piece of 5 crosses the seam
        assert!(matches!(a.alloc(5 * ALIGN), Err(ArenaError::Full { .. })));
        let x = a.alloc(4 * ALIGN).unwrap();
        let y = a.alloc(3 * ALIGN).unwrap();
        assert_eq!((x, y), (4 * ALIGN, 8 * ALIGN));
        assert!(a.contains(y, 3 * ALIGN) && !a.contains(x, 5 * ALIGN));
        // freed back to back: still two segments, not one run of 8
        a.free(x).unwrap();
        a.free(y).unwrap();
        assert!(matches!(a.alloc(5 * ALIGN), Err(ArenaError::Full { .. })));
        assert_eq!(a.alloc(2 * ALIGN).unwrap(), 4 * ALIGN);
        // the far segment is used once the others are full
        a.alloc(2 * ALIGN).unwrap();
        a.alloc(4 * ALIGN).unwrap();
        assert_eq!(a.alloc(ALIGN).unwrap(), 64 * ALIGN);
    }

    #[test]
    fn overlapping_segments_are_refused_and_change_nothing() {
        let mut a = StagingArena::new(8 * ALIGN, 4 * ALIGN).unwrap();
        for (b, l) in [
            (8 * ALIGN, ALIGN),
            (6 * ALIGN, 3 * ALIGN),
            (11 * ALIGN, 4 * ALIGN),
            (4 * ALIGN, 16 * ALIGN),
        ] {
            assert_eq!(a.add_segment(b, l), Err(ArenaError::Overlap { base: b, len: l }));
        }
        assert_eq!(a.segments(), (1, 4 * ALIGN));
        assert_eq!(a.region(), (8 * ALIGN, 4 * ALIGN));
        a.add_segment(12 * ALIGN, ALIGN).unwrap();
        assert_eq!(a.segments(), (2, 5 * ALIGN));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]
        /// Segments of any size and alignment, some touching, and any
        /// sequence of allocations and frees: a piece is aligned, lies
        /// inside one segment and overlaps no other live piece; every byte
        /// freed comes back (all free again: the largest piece each segment
        /// can hold fits again).
        #[test]
        fn pieces_are_disjoint_and_inside_one_segment(
            gaps in proptest::collection::vec((0u64..3, 1u64..2048), 1..6),
            ops in proptest::collection::vec((proptest::bool::ANY, 1u64..1500, 0usize..16), 1..80),
        ) {
            let mut a = StagingArena::empty();
            let mut segs = Vec::new();
            let mut at = 4096 + 17;
            for (gap, len) in gaps {
                // gap 0: this segment begins where the last one ended
                at += gap * 300;
                if a.add_segment(at, len).is_ok() {
                    segs.push((at, at + len));
                }
                at += len;
            }
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (alloc, len, pick) in ops {
                if alloc || live.is_empty() {
                    if let Ok(p) = a.alloc(len) {
                        proptest::prop_assert_eq!(p % ALIGN, 0);
                        proptest::prop_assert!(segs.iter().any(|&(s, e)| s <= p && p + len <= e));
                        proptest::prop_assert!(a.contains(p, len));
                        proptest::prop_assert!(live.iter().all(|&(q, l)| p + len <= q || q + l <= p));
                        live.push((p, len));
                    }
                } else {
                    let (p, _) = live.swap_remove(pick % live.len());
                    a.free(p).unwrap();
                }
            }
            for (p, _) in live.drain(..) {
                a.free(p).unwrap();
            }
            proptest::prop_assert_eq!((a.used_bytes(), a.pieces()), (0, 0));
            for &(s, e) in &segs {
                let start = s.div_ceil(ALIGN) * ALIGN;
                let whole = (e - start) / ALIGN * ALIGN;
                if whole > 0 {
                    let p = a.alloc(whole).unwrap();
                    proptest::prop_assert!(s <= p && p + whole <= e);
                }
            }
        }
    }
}
