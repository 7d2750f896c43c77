//! A first-fit allocator over one registered staging region. It hands out
//! disjoint, aligned pieces and takes each back exactly once; what it holds
//! is the only record of which staging bytes are in use, so two live
//! requests can never be given overlapping memory.

use std::collections::BTreeMap;

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
    #[error("a staging region of {len} bytes at {base:#x} is empty or overflows")]
    BadRegion { base: u64, len: u64 },
}

/// Pieces of `[base, base + len)`.
#[derive(Debug, Clone)]
pub struct StagingArena {
    base: u64,
    len: u64,
    /// Free pieces, start → length; adjacent ones are always merged.
    free: BTreeMap<u64, u64>,
    /// Pieces in use, start → length.
    used: BTreeMap<u64, u64>,
}

impl StagingArena {
    /// An arena over `len` bytes at `base` (the first aligned address on).
    pub fn new(base: u64, len: u64) -> Result<Self, ArenaError> {
        let end = base.checked_add(len).ok_or(ArenaError::BadRegion { base, len })?;
        let start = base
            .checked_add(ALIGN - 1)
            .map(|b| b / ALIGN * ALIGN)
            .filter(|&s| s < end && base != 0)
            .ok_or(ArenaError::BadRegion { base, len })?;
        let mut free = BTreeMap::new();
        free.insert(start, end - start);
        Ok(Self {
            base,
            len,
            free,
            used: BTreeMap::new(),
        })
    }

    /// The region: `(base, len)`.
    pub fn region(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    /// Whether `[addr, addr + len)` lies inside the region.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
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
        if let Some((&s, &l)) = self.free.range(..at).next_back() {
            if s + l == at {
                self.free.remove(&s);
                start = s;
            }
        }
        if let Some(&l) = self.free.get(&end) {
            self.free.remove(&end);
            end += l;
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
}
