//! KV geometry: where each (layer, block) of a rank's KV cache lives, and how
//! a producer's blocks map onto a consumer's under tensor parallelism.
//!
//! A layer is one or more *planes*: arrays of equally sized blocks, block `b`
//! at `base + b * block_stride`, `block_bytes` long. vLLM's CPU layout has one
//! plane per layer (K and V together); layouts with K and V apart have two.
//! Inside a block, when `head_major` is set, the rank's KV heads are
//! contiguous equal slices — which is what lets a producer of one TP size
//! write into a consumer of another.
//!
//! **Groups** (vLLM's hybrid KV cache manager): each layer takes its blocks
//! from one KV cache *group* (full attention, sliding window, ...), and a
//! request holds one block table per group. OrbitKV passes a request's
//! tables as one list, group-major: `groups` equal segments, segment `g`
//! holding the request's blocks of group `g` in request order. A
//! [`HOLE`] in a table is a block the rank does not hold (vLLM's null
//! block: a sliding-window block outside the window), never written to or
//! read from: a consumer's hole is skipped, and a producer's hole where the
//! consumer holds a block fails the write (`GeometryError::SourceReleased`:
//! decode then recomputes, it never decodes from an unwritten block). Layers of different groups may share their memory (vLLM
//! gives one tensor to one layer of each group, and one block pool to all
//! groups), so a block id names the same bytes in each of them, and the
//! block belongs to one group's request at a time.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::error::GeometryError;

/// One WRITE: `len` bytes from local `src` to the peer's virtual address
/// `dst` (what a layer's plan is made of; the transport moves it). Laid out
/// as the FFI's `OkvRange`, so a plan goes to Mooncake without a copy.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WriteRange {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// One array of blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plane {
    pub base: u64,
    pub block_stride: u64,
    pub block_bytes: u64,
}

impl Plane {
    /// Address of block `b`.
    pub fn block_addr(&self, b: u32) -> u64 {
        self.base + b as u64 * self.block_stride
    }

    /// End (exclusive) of the plane for `num_blocks` blocks; `None` on overflow.
    fn end(&self, num_blocks: u32) -> Option<u64> {
        let last = (num_blocks as u64).checked_sub(1)?;
        self.base
            .checked_add(last.checked_mul(self.block_stride)?)?
            .checked_add(self.block_bytes)
    }
}

/// In a block table: a block the rank does not hold (vLLM's null block,
/// e.g. a sliding-window block outside the window). Nothing is written to
/// or read from it.
pub const HOLE: u32 = u32::MAX;

/// The most KV cache groups a layout may have (vLLM makes a handful).
pub const MAX_GROUPS: u32 = 64;

/// A layer's planes.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerGeometry {
    pub planes: Vec<Plane>,
    /// The KV cache group whose block table this layer's blocks come from
    /// (0 for a model with one group; left out of the wire then).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub group: u32,
}

fn is_zero(g: &u32) -> bool {
    *g == 0
}

/// A rank's KV cache geometry.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvLayout {
    /// Blocks in every plane.
    pub num_blocks: u32,
    /// Tokens per block (informative; both sides must agree).
    pub block_size: u32,
    /// KV heads of the whole model (all ranks together).
    pub total_kv_heads: u32,
    /// This rank and the TP size of its instance.
    pub tp_rank: u32,
    pub tp_size: u32,
    /// Whether heads are contiguous equal slices inside each block.
    pub head_major: bool,
    pub layers: Vec<LayerGeometry>,
    /// How each block holds its tokens, where the rank knows it: what lets
    /// a producer write into a consumer of another block size (absent:
    /// only an equal block size is served).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_order: Option<TokenOrder>,
}

/// How a block of every plane holds its `block_size` tokens: `units` equal
/// units one after another (a unit is one KV head where `units` is the
/// rank's head count), each unit the `parts` one after another, a part
/// `rows` rows of `block_size` tokens of `token_bytes` each, tokens in
/// order. So token `t` of row `r` of part `k` of unit `u` lies at
/// `u · unit_bytes + offset(k) + (r · block_size + t) · token_bytes`.
///
/// vLLM's GPU layouts have one part of one row (`[block_size, content]`
/// per head under HND, per block under NHD); its CPU kernels keep a head's
/// K transposed (`head_size` rows of one element a token) and then its V
/// (one row of `head_size` elements a token): two parts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenOrder {
    pub units: u32,
    pub parts: Vec<TokenPart>,
}

/// Rows of tokens (see [`TokenOrder`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenPart {
    pub rows: u32,
    pub token_bytes: u64,
}

impl TokenOrder {
    /// At most this many parts, and rows in all parts of a unit: each row
    /// of each unit is a range per piece of a block, so the bound keeps a
    /// hostile geometry from making a producer plan millions of ranges.
    pub const MAX_PARTS: usize = 8;
    pub const MAX_ROWS: u32 = 1024;

    /// Bytes of one unit of a block of `block_size` tokens (`None` on overflow).
    fn unit_bytes(&self, block_size: u32) -> Option<u64> {
        self.parts.iter().try_fold(0u64, |acc, p| {
            (p.rows as u64)
                .checked_mul(block_size as u64)?
                .checked_mul(p.token_bytes)?
                .checked_add(acc)
        })
    }

    fn check(&self, block_size: u32, block_bytes: u64) -> Result<(), &'static str> {
        let rows: u64 = self.parts.iter().map(|p| p.rows as u64).sum();
        if self.units == 0 || self.parts.is_empty() || self.parts.len() > Self::MAX_PARTS {
            return Err("token order: no unit, or no part, or more than 8 parts");
        }
        if self.parts.iter().any(|p| p.rows == 0 || p.token_bytes == 0) || rows > Self::MAX_ROWS as u64 {
            return Err("token order: a part of no row or no byte, or more than 1024 rows");
        }
        let whole = self
            .unit_bytes(block_size)
            .and_then(|u| u.checked_mul(self.units as u64));
        if whole != Some(block_bytes) {
            return Err("token order does not add up to the block's bytes");
        }
        Ok(())
    }
}

/// A half-open interval of KV heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Heads {
    start: u32,
    end: u32,
}

impl Heads {
    fn len(self) -> u32 {
        self.end - self.start
    }

    /// The heads both hold (empty when `start >= end`).
    fn overlap(self, other: Heads) -> Heads {
        Heads {
            start: self.start.max(other.start),
            end: self.end.min(other.end),
        }
    }
}

/// The KV heads rank `rank` of TP size `tp` holds, of `total`: an equal
/// slice when `total >= tp`; otherwise vLLM replicates each head on
/// `tp / total` consecutive ranks and the rank holds one.
fn rank_heads(total: u32, tp: u32, rank: u32) -> Heads {
    if total >= tp {
        let per = total / tp.max(1);
        Heads {
            start: rank * per,
            end: (rank + 1) * per,
        }
    } else {
        let h = rank / (tp / total.max(1)).max(1);
        Heads { start: h, end: h + 1 }
    }
}

/// The KV heads rank `rank` of an instance of TP size `tp` holds, of `total`.
pub fn rank_heads_range(total: u32, tp: u32, rank: u32) -> Range<u32> {
    let h = rank_heads(total, tp, rank);
    h.start..h.end
}

/// For each head of `wanted`, the lowest rank of an instance of TP size
/// `tp` that holds it.
fn senders(total: u32, wanted: Heads, tp: u32) -> std::collections::BTreeSet<u32> {
    let tp = tp.max(1);
    (wanted.start..wanted.end)
        .map(|h| {
            if total >= tp {
                h / (total / tp).max(1)
            } else {
                h * (tp / total.max(1))
            }
        })
        .collect()
}

/// The producer ranks (TP size `producer_tp`) that send to consumer rank
/// `consumer_rank` of TP size `consumer_tp`, for a model of `total` KV heads
/// (the single source of the TP fan-in: the consumer's expected producers,
/// the ranks decode sends its handshake to, the producer's admission check).
pub fn producer_ranks_for(
    total: u32,
    consumer_rank: u32,
    consumer_tp: u32,
    producer_tp: u32,
) -> std::collections::BTreeSet<u32> {
    senders(total, rank_heads(total, consumer_tp, consumer_rank), producer_tp)
}

impl KvLayout {
    /// The layout of one contiguous region starting at `base`: `layers`
    /// layers one after another, each one plane of `blocks` blocks of
    /// `block_bytes` (heads contiguous inside a block, as vLLM's CPU layout),
    /// block size 16 tokens. This rank is `tp.0` of TP size `tp.1` of a model
    /// with `total_kv_heads` KV heads.
    pub fn packed(
        base: u64,
        layers: u32,
        blocks: u32,
        block_bytes: u64,
        tp: (u32, u32),
        total_kv_heads: u32,
    ) -> Self {
        KvLayout {
            num_blocks: blocks,
            block_size: 16,
            total_kv_heads,
            tp_rank: tp.0,
            tp_size: tp.1,
            head_major: true,
            layers: (0..layers as u64)
                .map(|l| LayerGeometry {
                    planes: vec![Plane {
                        base: base + l * blocks as u64 * block_bytes,
                        block_stride: block_bytes,
                        block_bytes,
                    }],
                    group: 0,
                })
                .collect(),
            token_order: None,
        }
    }

    /// Largest block accepted (no KV block comes near it; a larger value
    /// is a corrupt or hostile geometry).
    pub const MAX_BLOCK_BYTES: u64 = 1 << 40;

    /// How many KV cache groups its layers take blocks from (1 + the
    /// highest group; [`Self::validate`] checks that every group has a layer).
    pub fn groups(&self) -> u32 {
        self.layers
            .iter()
            .map(|l| l.group)
            .max()
            .map_or(1, |g| g.saturating_add(1))
    }

    /// Request blocks in a block table of `len` ids (one segment a group).
    pub fn request_blocks(&self, len: usize) -> usize {
        len / self.groups().max(1) as usize
    }

    /// Group `group`'s segment of a block table (empty when out of range).
    pub fn segment<'a>(&self, table: &'a [u32], group: u32) -> &'a [u32] {
        let n = self.request_blocks(table.len());
        let start = group as usize * n;
        table.get(start..start + n).unwrap_or(&[])
    }

    /// The heads this rank holds.
    fn heads(&self) -> Heads {
        rank_heads(self.total_kv_heads, self.tp_size, self.tp_rank)
    }

    pub(crate) fn local_heads(&self) -> u32 {
        self.heads().len()
    }

    /// The KV heads this rank holds, of the model's `total_kv_heads`.
    pub fn heads_range(&self) -> Range<u32> {
        let h = self.heads();
        h.start..h.end
    }

    /// The producer ranks, of an instance of TP size `producer_tp`, that
    /// send to this consumer rank: for each head this rank holds, the lowest
    /// producer rank holding it (when vLLM replicates KV heads over ranks,
    /// exactly one replica sends). The consumer waits for each of them.
    pub fn producer_ranks(&self, producer_tp: u32) -> std::collections::BTreeSet<u32> {
        senders(self.total_kv_heads, self.heads(), producer_tp)
    }

    /// Checks internal consistency: planes well formed, nothing overlapping,
    /// TP numbers sensible, no address arithmetic overflow.
    pub fn validate(&self) -> Result<(), GeometryError> {
        if self.layers.is_empty() {
            return Err(GeometryError::NoLayers);
        }
        if self.tp_size == 0 || self.tp_rank >= self.tp_size {
            return Err(GeometryError::TensorParallel(format!(
                "rank {} of size {}",
                self.tp_rank, self.tp_size
            )));
        }
        if self.total_kv_heads == 0
            || (self.total_kv_heads % self.tp_size != 0 && self.tp_size % self.total_kv_heads != 0)
        {
            return Err(GeometryError::TensorParallel(format!(
                "{} KV heads neither split over nor replicate evenly on {} ranks",
                self.total_kv_heads, self.tp_size
            )));
        }
        if self.num_blocks == 0 {
            return Err(GeometryError::BadPlane {
                layer: 0,
                plane: 0,
                reason: "zero blocks".into(),
            });
        }
        let groups = self.groups();
        if groups > MAX_GROUPS {
            return Err(GeometryError::Groups(format!(
                "{groups} groups, at most {MAX_GROUPS}"
            )));
        }
        if let Some(g) = (0..groups).find(|&g| !self.layers.iter().any(|l| l.group == g)) {
            return Err(GeometryError::Groups(format!("group {g} has no layer")));
        }
        let expected = self.layers[0].planes.len();
        // (start, end, layer, plane); a plane may alias another only on the
        // same pages (base and stride) in another group (vLLM's shared
        // tensors, attention KV and Mamba state alike).
        let mut spans: Vec<(u64, u64, u32, usize)> = Vec::new();
        for (li, layer) in self.layers.iter().enumerate() {
            let li = li as u32;
            if layer.planes.len() != expected || expected == 0 {
                return Err(GeometryError::PlaneCount {
                    layer: li,
                    found: layer.planes.len(),
                    expected,
                });
            }
            for (pi, p) in layer.planes.iter().enumerate() {
                let bad = |reason: &str| GeometryError::BadPlane {
                    layer: li,
                    plane: pi,
                    reason: reason.into(),
                };
                if p.base == 0 {
                    return Err(bad("null base address"));
                }
                if p.block_bytes == 0 {
                    return Err(bad("zero block bytes"));
                }
                if p.block_bytes > Self::MAX_BLOCK_BYTES {
                    return Err(bad("block bytes over 1 TiB"));
                }
                if self.num_blocks > 1 && p.block_stride < p.block_bytes {
                    return Err(bad("block stride smaller than block bytes (blocks overlap)"));
                }
                if self.head_major && p.block_bytes % self.local_heads() as u64 != 0 {
                    return Err(bad("block bytes do not split evenly into heads"));
                }
                if let Some(order) = &self.token_order {
                    if self.block_size == 0 {
                        return Err(bad("a token order with a block size of 0 tokens"));
                    }
                    order.check(self.block_size, p.block_bytes).map_err(bad)?;
                }
                let end = p
                    .end(self.num_blocks)
                    .ok_or_else(|| bad("address range overflows"))?;
                spans.push((p.base, end, li, pi));
            }
        }
        spans.sort_unstable();
        let plane = |l: u32, p: usize| (self.layers[l as usize].group, self.layers[l as usize].planes[p]);
        // The groups of the run of planes on one page array the window is in.
        let mut run: Vec<u32> = Vec::new();
        for w in spans.windows(2) {
            let (a, b) = (w[0], w[1]);
            let (ga, pa) = plane(a.2, a.3);
            let (gb, pb) = plane(b.2, b.3);
            if pa.base == pb.base && pa.block_stride == pb.block_stride {
                // One array of pages given to one layer of each group (a
                // block of attention KV, or of recurrent state, at the start
                // of its page): a block id names the same page in all of
                // them, and one pool hands it to one group at a time. Two
                // layers of one group may not share.
                if run.is_empty() {
                    run.push(ga);
                }
                if !run.contains(&gb) {
                    run.push(gb);
                    continue;
                }
            } else {
                run.clear();
            }
            if b.0 < a.1 {
                return Err(GeometryError::Overlap {
                    a_layer: a.2,
                    a_plane: a.3,
                    b_layer: b.2,
                    b_plane: b.3,
                });
            }
        }
        Ok(())
    }

    /// Checks a block table: one equal segment a group, every block id in
    /// range and listed once in the whole table (all groups draw on one
    /// pool), [`HOLE`]s aside.
    pub fn validate_blocks(&self, blocks: &[u32]) -> Result<(), GeometryError> {
        let groups = self.groups() as usize;
        if blocks.len() % groups != 0 {
            return Err(GeometryError::Groups(format!(
                "a block table of {} ids is not {groups} equal segments, one a group",
                blocks.len()
            )));
        }
        let mut seen = std::collections::HashSet::with_capacity(blocks.len());
        for &b in blocks {
            if b == HOLE {
                continue;
            }
            if b >= self.num_blocks {
                return Err(GeometryError::BlockOutOfRange {
                    block: b,
                    num_blocks: self.num_blocks,
                });
            }
            if !seen.insert(b) {
                return Err(GeometryError::DuplicateBlock { block: b });
            }
        }
        Ok(())
    }

    /// Whether this producer rank is one `consumer` waits for (it holds
    /// some of the consumer's heads and is the lowest replica of them).
    pub fn overlaps_heads(&self, consumer: &KvLayout) -> bool {
        consumer.producer_ranks(self.tp_size).contains(&self.tp_rank)
    }

    /// How many producer ranks of TP size `producer_tp` this consumer rank
    /// waits for.
    pub fn expected_producers(&self, producer_tp: u32) -> u32 {
        self.producer_ranks(producer_tp).len() as u32
    }

    /// Checks that this (producer) layout can write into `consumer`.
    pub fn check_compatible(&self, consumer: &KvLayout) -> Result<(), GeometryError> {
        if self.layers.len() != consumer.layers.len() {
            return Err(GeometryError::LayerCount {
                producer: self.layers.len(),
                consumer: consumer.layers.len(),
            });
        }
        if let Some(l) = (0..self.layers.len()).find(|&l| self.layers[l].group != consumer.layers[l].group) {
            return Err(GeometryError::Groups(format!(
                "layer {l} takes blocks from group {} on the producer, {} on the consumer",
                self.layers[l].group, consumer.layers[l].group
            )));
        }
        if self.total_kv_heads != consumer.total_kv_heads {
            return Err(GeometryError::TensorParallel(format!(
                "producer model has {} KV heads, consumer {}",
                self.total_kv_heads, consumer.total_kv_heads
            )));
        }
        let bigger = self.tp_size.max(consumer.tp_size);
        let smaller = self.tp_size.min(consumer.tp_size);
        if bigger % smaller != 0 {
            return Err(GeometryError::TensorParallel(format!(
                "TP sizes {} and {} are not multiples",
                self.tp_size, consumer.tp_size
            )));
        }
        if !self.overlaps_heads(consumer) {
            return Err(GeometryError::TensorParallel(format!(
                "producer rank {}/{} does not send to consumer rank {}/{} (it holds none of its heads, \
                 or a lower rank holds the same replica)",
                self.tp_rank, self.tp_size, consumer.tp_rank, consumer.tp_size
            )));
        }
        // A side whose whole block is written (every head it holds is in the
        // slice) needs no head-major layout: one replicated head (MLA's
        // latent, or fewer KV heads than ranks) is sent as whole blocks.
        let (p, c) = (self.heads(), consumer.heads());
        let sent = p.overlap(c);
        if sent != c && !consumer.head_major {
            return Err(GeometryError::TensorParallel(
                "consumer blocks are not head-major, so a producer of larger TP cannot write a head slice"
                    .into(),
            ));
        }
        if sent != p && !self.head_major {
            return Err(GeometryError::TensorParallel(
                "producer blocks are not head-major, so a consumer of larger TP cannot take a head slice"
                    .into(),
            ));
        }
        // Another block size needs both token orders; known on both sides,
        // they must agree for an equal one too (a head-major side and a
        // token-major one would otherwise exchange blocks as opaque bytes).
        let known = self.token_order.is_some() && consumer.token_order.is_some();
        if self.block_size != consumer.block_size || known {
            self.check_token_orders(consumer)?;
        }
        // u128: block sizes come from the network and may be near 2^64.
        let (ph, ch) = (self.local_heads() as u128, consumer.local_heads() as u128);
        for (li, (pl, cl)) in self.layers.iter().zip(&consumer.layers).enumerate() {
            if pl.planes.len() != cl.planes.len() {
                return Err(GeometryError::PlaneCount {
                    layer: li as u32,
                    found: cl.planes.len(),
                    expected: pl.planes.len(),
                });
            }
            // Bytes per head and token (blocks of either size).
            let (pt, ct) = (self.block_size.max(1) as u128, consumer.block_size.max(1) as u128);
            for (pi, (pp, cp)) in pl.planes.iter().zip(&cl.planes).enumerate() {
                if pp.block_bytes as u128 * ch * ct != cp.block_bytes as u128 * ph * pt {
                    return Err(GeometryError::HeadBytes {
                        layer: li as u32,
                        plane: pi,
                        what: "bytes per token",
                        producer: (pp.block_bytes as u128 / ph / pt) as u64,
                        consumer: (cp.block_bytes as u128 / ch / ct) as u64,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks that this producer can write into `consumer`, whose blocks
    /// hold another number of tokens: both say how their blocks hold their
    /// tokens, the units hold the same rows of the same token bytes, and a
    /// unit names the same data on both sides (all of a block, or under
    /// head slices one KV head).
    fn check_token_orders(&self, consumer: &KvLayout) -> Result<(), GeometryError> {
        let refuse = |why: String| {
            Err(GeometryError::TokenOrder {
                producer: self.block_size,
                consumer: consumer.block_size,
                why,
            })
        };
        let (Some(po), Some(co)) = (&self.token_order, &consumer.token_order) else {
            let side = if self.token_order.is_none() {
                "the producer"
            } else {
                "the consumer"
            };
            return refuse(format!(
                "{side} does not say how its blocks hold their tokens (an attention kernel layout \
                 OrbitKV does not know, or an OrbitKV without mixed block sizes)"
            ));
        };
        if po.parts != co.parts {
            return refuse(format!(
                "the blocks hold their tokens differently (producer {:?}, consumer {:?})",
                po.parts, co.parts
            ));
        }
        let (p, c) = (self.heads(), consumer.heads());
        let whole = p == c;
        let by_head = po.units == self.local_heads()
            && co.units == consumer.local_heads()
            && self.head_major
            && consumer.head_major;
        if whole && po.units != co.units {
            return refuse(format!(
                "a block is {} units on the producer and {} on the consumer",
                po.units, co.units
            ));
        }
        if !whole && !by_head {
            return refuse("head slices need one unit a KV head on both sides, heads outermost".into());
        }
        Ok(())
    }

    /// Layer `layer` of this layout and of `consumer`.
    fn layer_pair<'a>(
        &'a self,
        consumer: &'a KvLayout,
        layer: u32,
    ) -> Result<(&'a LayerGeometry, &'a LayerGeometry), GeometryError> {
        match (
            self.layers.get(layer as usize),
            consumer.layers.get(layer as usize),
        ) {
            (Some(pl), Some(cl)) => Ok((pl, cl)),
            _ => Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: self.layers.len(),
            }),
        }
    }

    /// The byte ranges that write request blocks `indices` of `layer` from
    /// this producer into `consumer`. `src_blocks[i]` goes to `dst_blocks[i]`.
    /// Contiguous runs are coalesced into one range. Every destination range
    /// lies inside an authorized block: an index outside `dst_blocks` is an
    /// error, never a write.
    pub fn plan_layer(
        &self,
        consumer: &KvLayout,
        layer: u32,
        src_blocks: &[u32],
        dst_blocks: &[u32],
        indices: std::ops::Range<u32>,
        out: &mut Vec<WriteRange>,
    ) -> Result<(), GeometryError> {
        let (pl, cl) = self.layer_pair(consumer, layer)?;
        if indices.end as usize > dst_blocks.len() {
            return Err(GeometryError::OutsideAuthorization {
                index: indices.end - 1,
                authorized: dst_blocks.len(),
            });
        }
        if indices.end as usize > src_blocks.len() {
            return Err(GeometryError::OutsideSource {
                index: indices.end - 1,
                available: src_blocks.len(),
            });
        }
        let (p, c) = (self.heads(), consumer.heads());
        let Heads { start, end } = p.overlap(c);
        if start >= end {
            return Ok(());
        }
        let (ph, ch) = (self.local_heads() as u64, consumer.local_heads() as u64);
        for (pp, cp) in pl.planes.iter().zip(&cl.planes) {
            let head_bytes = pp.block_bytes / ph;
            let src_off = (start - p.start) as u64 * head_bytes;
            let dst_off = (start - c.start) as u64 * head_bytes;
            let len = (end - start) as u64 * head_bytes;
            debug_assert_eq!(cp.block_bytes / ch, head_bytes);
            let first = out.len();
            for i in indices.clone() {
                let (s, d) = (src_blocks[i as usize], dst_blocks[i as usize]);
                if d == HOLE {
                    // The consumer holds no block there: nothing to write.
                    continue;
                }
                if s == HOLE {
                    // The consumer needs a block the producer gave back:
                    // the request fails (decode recomputes), nothing is read.
                    out.truncate(first);
                    return Err(GeometryError::SourceReleased { layer, index: i });
                }
                let r = WriteRange {
                    src: pp.block_addr(s) + src_off,
                    dst: cp.block_addr(d) + dst_off,
                    len,
                };
                push_merged(out, first, r);
            }
        }
        Ok(())
    }
}

/// Appends `r` to `out`, merged into the last range when both its source
/// and its destination continue it, or both end right where it starts
/// (never into a range before `first`). The merged range covers exactly the
/// bytes of the two.
///
/// The second case matters under vLLM: its block pool frees a request's
/// blocks in reverse order and hands them out again from the front of its
/// free queue, so once the pool has been cycled a request's blocks come in
/// *descending* runs, on prefill and on decode alike. Pairs of blocks that
/// both step down by one are as contiguous as pairs that both step up: the
/// run is one range, not one range per block.
pub(crate) fn push_merged(out: &mut Vec<WriteRange>, first: usize, r: WriteRange) {
    if out.len() > first {
        if let Some(last) = out.last_mut() {
            if last.src.checked_add(last.len) == Some(r.src) && last.dst.checked_add(last.len) == Some(r.dst)
            {
                last.len += r.len;
                return;
            }
            if r.src.checked_add(r.len) == Some(last.src) && r.dst.checked_add(r.len) == Some(last.dst) {
                last.src = r.src;
                last.dst = r.dst;
                last.len += r.len;
                return;
            }
        }
    }
    out.push(r);
}

/// Where an authorization lets a producer write: the consumer's layout and
/// its blocks for request blocks `first_block..` (the fields of a
/// `wire::Handshake` the planners need, so that planning does not depend on
/// the wire format: `Handshake::target`).
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    pub layout: &'a KvLayout,
    pub block_ids: &'a [u32],
    pub first_block: u32,
    /// The request's tokens the consumer loads, counted from its start
    /// (0: not said; then only an equal block size is served).
    pub tokens: u32,
}

/// Turns an admitted write (a `Submit`) into byte ranges inside `auth`, as
/// the producer actor does before handing them to a layer writer. Pure, so
/// the property test (`tests/contract_props.rs`) plans exactly as the actor
/// does. Request blocks before `auth.first_block` the consumer already holds
/// and are skipped; the rest are shifted into the authorization's indices.
/// `Ok` with `out` empty: nothing to write. An index outside the
/// authorization (or the source blocks) is an error, never a range.
pub fn plan_write(
    local: &KvLayout,
    src_blocks: &[u32],
    auth: Target<'_>,
    layer: u32,
    blocks: Range<u32>,
    out: &mut Vec<WriteRange>,
) -> Result<(), GeometryError> {
    out.clear();
    let group = local.layers.get(layer as usize).map_or(0, |l| l.group);
    let src = local.segment(src_blocks, group);
    let dst = auth.layout.segment(auth.block_ids, group);
    if local.block_size != auth.layout.block_size {
        // `first_block` counts the consumer's blocks: compared in tokens.
        return local.plan_tokens(auth, layer, src, dst, blocks, out);
    }
    let first = auth.first_block;
    let (lo, hi) = (blocks.start.max(first), blocks.end);
    if lo >= hi {
        return Ok(());
    }
    let src = src.get(first as usize..).unwrap_or(&[]);
    local.plan_layer(auth.layout, layer, src, dst, (lo - first)..(hi - first), out)
}

/// A run of tokens that lies in one producer block and one consumer block.
#[derive(Debug, Clone, Copy)]
struct Piece {
    src: u32,
    dst: u32,
    /// First token's place in the producer's and the consumer's block.
    src_at: u64,
    dst_at: u64,
    tokens: u64,
}

impl KvLayout {
    /// [`plan_write`] for a consumer of another block size (its caller has
    /// checked [`KvLayout::check_compatible`]): the tokens of producer
    /// request blocks `blocks` that the consumer loads (from its
    /// `first_block`, below `auth.tokens`) are cut where either side's
    /// block ends, and each piece is written row by row of each unit
    /// ([`TokenOrder`]). A consumer hole is skipped, a producer hole the
    /// consumer needs fails (`SourceReleased`), a token outside the
    /// authorized blocks or the source blocks is an error, never a write.
    fn plan_tokens(
        &self,
        auth: Target<'_>,
        layer: u32,
        src: &[u32],
        dst: &[u32],
        blocks: Range<u32>,
        out: &mut Vec<WriteRange>,
    ) -> Result<(), GeometryError> {
        let consumer = auth.layout;
        let refuse = |why: &str| GeometryError::TokenOrder {
            producer: self.block_size,
            consumer: consumer.block_size,
            why: why.into(),
        };
        let (Some(po), Some(co)) = (&self.token_order, &consumer.token_order) else {
            return Err(refuse("a side does not say how its blocks hold their tokens"));
        };
        if auth.tokens == 0 {
            return Err(refuse(
                "the handshake does not say how many tokens the consumer loads",
            ));
        }
        let (pl, cl) = self.layer_pair(consumer, layer)?;
        let (pb, cb) = (self.block_size as u64, consumer.block_size as u64);
        let first = auth.first_block as u64;
        let lo = (blocks.start as u64 * pb).max(first * cb);
        let hi = (blocks.end as u64 * pb).min(auth.tokens as u64);
        if lo >= hi {
            return Ok(());
        }
        // The consumer's blocks and the producer's must hold every token.
        let last = hi - 1;
        if last / cb - first >= dst.len() as u64 {
            return Err(GeometryError::OutsideAuthorization {
                index: (last / cb - first).min(u32::MAX as u64) as u32,
                authorized: dst.len(),
            });
        }
        if last / pb >= src.len() as u64 {
            return Err(GeometryError::OutsideSource {
                index: (last / pb).min(u32::MAX as u64) as u32,
                available: src.len(),
            });
        }
        let mut pieces = Vec::new();
        let mut t = lo;
        while t < hi {
            let (src_at, dst_at) = (t % pb, t % cb);
            let n = (pb - src_at).min(cb - dst_at).min(hi - t);
            let (s, d) = (src[(t / pb) as usize], dst[(t / cb - first) as usize]);
            if d != HOLE {
                if s == HOLE {
                    return Err(GeometryError::SourceReleased {
                        layer,
                        index: (t / pb) as u32,
                    });
                }
                pieces.push(Piece {
                    src: s,
                    dst: d,
                    src_at,
                    dst_at,
                    tokens: n,
                });
            }
            t += n;
        }
        // Units sent: the whole block, or the KV heads both hold.
        let (p, c) = (self.heads(), consumer.heads());
        let units: Vec<(u64, u64)> = if p == c {
            (0..po.units as u64).map(|u| (u, u)).collect()
        } else {
            let Heads { start, end } = p.overlap(c);
            (start..end)
                .map(|h| ((h - p.start) as u64, (h - c.start) as u64))
                .collect()
        };
        let (Some(pu), Some(cu)) = (po.unit_bytes(self.block_size), co.unit_bytes(consumer.block_size))
        else {
            return Err(refuse("token order overflows"));
        };
        for (pp, cp) in pl.planes.iter().zip(&cl.planes) {
            let first_range = out.len();
            for &(su, du) in &units {
                let (mut src_part, mut dst_part) = (su * pu, du * cu);
                for part in &po.parts {
                    let tb = part.token_bytes;
                    for r in 0..part.rows as u64 {
                        let (src_row, dst_row) = (src_part + r * pb * tb, dst_part + r * cb * tb);
                        for piece in &pieces {
                            let range = WriteRange {
                                src: pp.block_addr(piece.src) + src_row + piece.src_at * tb,
                                dst: cp.block_addr(piece.dst) + dst_row + piece.dst_at * tb,
                                len: piece.tokens * tb,
                            };
                            push_merged(out, first_range, range);
                        }
                    }
                    src_part += part.rows as u64 * pb * tb;
                    dst_part += part.rows as u64 * cb * tb;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A layout with one plane per layer, blocks of `block_bytes`, laid out
    /// one layer after another from `base`.
    pub(crate) fn layout(
        base: u64,
        layers: u32,
        blocks: u32,
        block_bytes: u64,
        tp: (u32, u32),
        heads: u32,
    ) -> KvLayout {
        KvLayout::packed(base, layers, blocks, block_bytes, tp, heads)
    }

    /// Layers `(group, tensor)`, each tensor `blocks` blocks of `bytes`
    /// from `base`, one tensor after another (vLLM's hybrid sharing).
    fn grouped(base: u64, layers: &[(u32, u32)], blocks: u32, bytes: u64) -> KvLayout {
        let tensors = layers.iter().map(|l| l.1).max().unwrap_or(0) + 1;
        let mut l = layout(base, tensors, blocks, bytes, (0, 1), 1);
        let planes: Vec<_> = l.layers.iter().map(|x| x.planes.clone()).collect();
        l.layers = layers
            .iter()
            .map(|&(group, t)| LayerGeometry {
                planes: planes[t as usize].clone(),
                group,
            })
            .collect();
        l
    }

    #[test]
    fn layers_of_different_groups_may_share_a_tensor_but_not_layers_of_one() {
        let ok = grouped(0x1000, &[(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)], 8, 256);
        ok.validate().unwrap();
        assert_eq!(ok.groups(), 3);
        // Two layers of group 0 on one tensor (through a layer of group 1).
        let same = grouped(0x1000, &[(0, 0), (1, 0), (0, 0)], 8, 256);
        assert!(matches!(same.validate(), Err(GeometryError::Overlap { .. })));
        // A plane of another group overlapping without being on the same pages.
        let mut part = grouped(0x1000, &[(0, 0), (1, 1)], 8, 256);
        part.layers[1].planes[0].base = 0x1000 + 256;
        assert!(matches!(part.validate(), Err(GeometryError::Overlap { .. })));
        // On the same pages with a shorter block (vLLM's Mamba state at the
        // start of a page an attention group's block fills): accepted, in
        // another group only.
        let mut state = grouped(0x1000, &[(0, 0), (1, 0)], 8, 256);
        state.layers[1].planes[0].block_bytes = 100;
        state.validate().unwrap();
        let mut stride = state.clone();
        stride.layers[1].planes[0].block_stride = 128;
        assert!(matches!(stride.validate(), Err(GeometryError::Overlap { .. })));
        let mut same_group = state.clone();
        same_group.layers[1].group = 0;
        same_group.layers.push(LayerGeometry {
            planes: same_group.layers[1].planes.clone(),
            group: 1,
        });
        assert!(matches!(
            same_group.validate(),
            Err(GeometryError::Overlap { .. })
        ));
        // A group with no layer, and too many groups.
        let gap = grouped(0x1000, &[(0, 0), (2, 1)], 8, 256);
        assert!(matches!(gap.validate(), Err(GeometryError::Groups(_))));
        let far = grouped(0x1000, &[(0, 0), (MAX_GROUPS, 1)], 8, 256);
        assert!(matches!(far.validate(), Err(GeometryError::Groups(_))));
        // One group: the wire form is the one single-group peers know.
        let one = layout(0x1000, 2, 8, 256, (0, 1), 2);
        assert!(!serde_json::to_string(&one).unwrap().contains("group"));
        assert!(serde_json::to_string(&ok).unwrap().contains("\"group\":1"));
    }

    #[test]
    fn block_tables_are_one_equal_segment_a_group_with_holes_skipped() {
        let l = grouped(0x1000, &[(0, 0), (1, 0)], 8, 256);
        l.validate_blocks(&[1, 2, HOLE, 3]).unwrap();
        l.validate_blocks(&[HOLE, HOLE]).unwrap();
        assert!(matches!(
            l.validate_blocks(&[1, 2, 3]),
            Err(GeometryError::Groups(_))
        ));
        assert!(matches!(
            l.validate_blocks(&[1, 2, 2, 3]),
            Err(GeometryError::DuplicateBlock { block: 2 })
        ));
        assert_eq!(l.segment(&[1, 2, 3, 4], 1), &[3, 4]);
        assert_eq!(l.segment(&[1, 2, 3, 4], 2), &[] as &[u32]);
        assert_eq!(l.request_blocks(4), 2);
    }

    #[test]
    fn each_layer_is_planned_from_and_into_its_own_groups_blocks_never_a_hole() {
        let p = grouped(0x10_0000, &[(0, 0), (1, 0)], 16, 256);
        let c = grouped(0x20_0000, &[(0, 0), (1, 0)], 16, 256);
        p.check_compatible(&c).unwrap();
        let dst = [4, 5, HOLE, 9];
        let auth = Target {
            tokens: 0,
            layout: &c,
            block_ids: &dst,
            first_block: 0,
        };
        let src = [1, 2, 3, 7];
        let mut out = Vec::new();
        plan_write(&p, &src, auth, 0, 0..2, &mut out).unwrap();
        assert_eq!(
            out,
            vec![WriteRange {
                src: 0x10_0000 + 256,
                dst: 0x20_0000 + 4 * 256,
                len: 512
            }]
        );
        plan_write(&p, &src, auth, 1, 0..2, &mut out).unwrap();
        assert_eq!(
            out,
            vec![WriteRange {
                src: 0x10_0000 + 7 * 256,
                dst: 0x20_0000 + 9 * 256,
                len: 256
            }]
        );
        // A source hole where the consumer holds a block: refused, not skipped.
        let src = [1, 2, 3, HOLE];
        assert!(matches!(
            plan_write(&p, &src, auth, 1, 0..2, &mut out),
            Err(GeometryError::SourceReleased { layer: 1, index: 1 })
        ));
        // The groups of a layer differ: refused before any write.
        let other = grouped(0x30_0000, &[(0, 0), (0, 1)], 16, 256);
        assert!(matches!(
            p.check_compatible(&other),
            Err(GeometryError::Groups(_))
        ));
    }

    #[test]
    fn valid_layout_passes() {
        layout(0x1000, 4, 8, 256, (0, 1), 2).validate().unwrap();
    }

    #[test]
    fn overlapping_layers_are_rejected() {
        let mut l = layout(0x1000, 2, 8, 256, (0, 1), 2);
        l.layers[1].planes[0].base = 0x1000 + 256 * 7;
        assert!(matches!(l.validate(), Err(GeometryError::Overlap { .. })));
    }

    #[test]
    fn stride_smaller_than_block_is_rejected() {
        let mut l = layout(0x1000, 1, 8, 256, (0, 1), 2);
        l.layers[0].planes[0].block_stride = 128;
        assert!(matches!(l.validate(), Err(GeometryError::BadPlane { .. })));
    }

    #[test]
    fn overflow_is_rejected() {
        let mut l = layout(u64::MAX - 10, 1, 8, 256, (0, 1), 2);
        l.layers[0].planes[0].base = u64::MAX - 10;
        assert!(matches!(l.validate(), Err(GeometryError::BadPlane { .. })));
    }

    #[test]
    fn replicated_kv_heads_have_exactly_one_sender() {
        // 1 KV head (block 128 B): TP 2 replicates it on both ranks.
        let p0 = layout(0x10_0000, 1, 4, 128, (0, 2), 1);
        let p1 = layout(0x20_0000, 1, 4, 128, (1, 2), 1);
        let c = layout(0x90_0000, 1, 4, 128, (0, 1), 1);
        p0.validate().unwrap();
        assert_eq!(c.expected_producers(2), 1);
        p0.check_compatible(&c).unwrap();
        assert!(matches!(
            p1.check_compatible(&c),
            Err(GeometryError::TensorParallel(_))
        ));
        let mut out = Vec::new();
        p0.plan_layer(&c, 0, &[0, 1], &[2, 3], 0..2, &mut out).unwrap();
        assert_eq!(
            out,
            vec![WriteRange {
                src: 0x10_0000,
                dst: 0x90_0000 + 2 * 128,
                len: 256
            }]
        );
        // TP 1 -> TP 2: the one producer fills each consumer rank's replica.
        let p = layout(0x10_0000, 1, 4, 128, (0, 1), 1);
        for rank in 0..2 {
            let c = layout(0x90_0000, 1, 4, 128, (rank, 2), 1);
            assert_eq!(c.producer_ranks(1), [0].into());
            p.check_compatible(&c).unwrap();
            out.clear();
            p.plan_layer(&c, 0, &[1], &[3], 0..1, &mut out).unwrap();
            assert_eq!(
                out,
                vec![WriteRange {
                    src: 0x10_0000 + 128,
                    dst: 0x90_0000 + 3 * 128,
                    len: 128
                }]
            );
        }
        // 2 heads on TP 4 (2 replicas each) -> TP 1: ranks 0 and 2 send a half each.
        let c = layout(0x90_0000, 1, 4, 256, (0, 1), 2);
        assert_eq!(c.producer_ranks(4), [0, 2].into());
        for (rank, sends) in [(0, true), (1, false), (2, true), (3, false)] {
            let p = layout(0x10_0000, 1, 4, 128, (rank, 4), 2);
            assert_eq!(p.check_compatible(&c).is_ok(), sends, "rank {rank}");
        }
        // 3 heads neither split over nor replicate on 2 ranks.
        assert!(layout(0x10_0000, 1, 4, 96, (0, 2), 3).validate().is_err());
    }

    #[test]
    fn whole_block_writes_need_no_head_major_layout() {
        // One replicated head (MLA's latent): the slice is the whole block on
        // both sides, so neither side's head order matters.
        let mut p0 = layout(0x10_0000, 1, 4, 128, (0, 2), 1);
        let mut c = layout(0x90_0000, 1, 4, 128, (0, 1), 1);
        p0.head_major = false;
        c.head_major = false;
        p0.check_compatible(&c).unwrap();
        let mut p = layout(0x10_0000, 1, 4, 128, (0, 1), 1);
        let mut c1 = layout(0x90_0000, 1, 4, 128, (1, 2), 1);
        p.head_major = false;
        c1.head_major = false;
        p.check_compatible(&c1).unwrap();
        // Head slices still need it: 2 heads, TP 2 -> 1 (consumer sliced) and
        // TP 1 -> 2 (producer sliced).
        let p0 = layout(0x10_0000, 1, 4, 128, (0, 2), 2);
        let mut c = layout(0x90_0000, 1, 4, 256, (0, 1), 2);
        c.head_major = false;
        assert!(
            matches!(p0.check_compatible(&c), Err(GeometryError::TensorParallel(m)) if m.contains("consumer"))
        );
        let mut p = layout(0x10_0000, 1, 4, 256, (0, 1), 2);
        p.head_major = false;
        let c1 = layout(0x90_0000, 1, 4, 128, (1, 2), 2);
        assert!(
            matches!(p.check_compatible(&c1), Err(GeometryError::TensorParallel(m)) if m.contains("producer"))
        );
    }

    #[test]
    fn huge_block_bytes_are_rejected_not_wrapped() {
        // 2^63 + 128: `block_bytes * heads` wraps in u64 (a panic in debug,
        // 256 bytes in release, as the hardening issue found).
        let producer = layout(0x1000, 1, 1, 256, (0, 1), 2);
        let mut consumer = layout(0x10_0000, 1, 1, 256, (0, 1), 2);
        consumer.layers[0].planes[0].block_bytes = (1u64 << 63) + 128;
        assert!(matches!(consumer.validate(), Err(GeometryError::BadPlane { .. })));
        assert!(matches!(
            producer.check_compatible(&consumer),
            Err(GeometryError::HeadBytes { .. })
        ));
        let mut c2 = layout(0x10_0000, 1, 1, 256, (0, 2), 2);
        c2.layers[0].planes[0].block_bytes = u64::MAX;
        assert!(producer.check_compatible(&c2).is_err());
    }

    #[test]
    fn blocks_out_of_range_or_duplicate() {
        let l = layout(0x1000, 1, 8, 256, (0, 1), 2);
        assert!(matches!(
            l.validate_blocks(&[1, 8]),
            Err(GeometryError::BlockOutOfRange { block: 8, .. })
        ));
        assert!(matches!(
            l.validate_blocks(&[1, 1]),
            Err(GeometryError::DuplicateBlock { block: 1 })
        ));
        l.validate_blocks(&[0, 7, 3]).unwrap();
    }

    #[test]
    fn same_tp_coalesces_contiguous_blocks() {
        let p = layout(0x10_0000, 2, 8, 256, (0, 1), 2);
        let c = layout(0x90_0000, 2, 8, 256, (0, 1), 2);
        p.check_compatible(&c).unwrap();
        let mut out = Vec::new();
        p.plan_layer(&c, 1, &[2, 3, 4, 0], &[5, 6, 7, 1], 0..4, &mut out)
            .unwrap();
        let pb = 0x10_0000 + 8 * 256;
        let cb = 0x90_0000 + 8 * 256;
        assert_eq!(
            out,
            vec![
                WriteRange {
                    src: pb + 2 * 256,
                    dst: cb + 5 * 256,
                    len: 3 * 256
                },
                WriteRange {
                    src: pb,
                    dst: cb + 256,
                    len: 256
                },
            ]
        );
    }

    #[test]
    fn blocks_descending_on_both_sides_coalesce_like_ascending_ones() {
        // vLLM hands a cycled pool's blocks out in descending runs.
        let p = layout(0x10_0000, 1, 16, 256, (0, 1), 2);
        let c = layout(0x90_0000, 1, 16, 256, (0, 1), 2);
        let mut out = Vec::new();
        p.plan_layer(
            &c,
            0,
            &[9, 8, 7, 6, 2, 3],
            &[13, 12, 11, 10, 0, 1],
            0..6,
            &mut out,
        )
        .unwrap();
        let (pb, cb) = (0x10_0000u64, 0x90_0000u64);
        assert_eq!(
            out,
            vec![
                WriteRange {
                    src: pb + 6 * 256,
                    dst: cb + 10 * 256,
                    len: 4 * 256
                },
                WriteRange {
                    src: pb + 2 * 256,
                    dst: cb,
                    len: 2 * 256
                },
            ]
        );
        // One side up, the other down: no two blocks are contiguous on both.
        p.plan_layer(&c, 0, &[3, 2, 1], &[4, 5, 6], 0..3, &mut out)
            .unwrap();
        assert_eq!(out.len(), 2 + 3);
    }

    #[test]
    fn head_slices_of_descending_blocks_are_not_merged() {
        // Consumer TP 1 holds 4 heads, the producer (rank 0 of 2) 2: each
        // range is half a destination block, so neighbours are never adjacent.
        let p = layout(0x10_0000, 1, 8, 128, (0, 2), 4);
        let c = layout(0x90_0000, 1, 8, 256, (0, 1), 4);
        let mut out = Vec::new();
        p.plan_layer(&c, 0, &[5, 4, 3], &[7, 6, 5], 0..3, &mut out)
            .unwrap();
        assert_eq!(out.len(), 3);
        assert!(out.iter().all(|r| r.len == 128));
    }

    /// Every byte a block-by-block plan writes, as (dst byte, src byte) pairs.
    fn byte_map(ranges: &[WriteRange]) -> Vec<(u64, u64)> {
        let mut m: Vec<(u64, u64)> = ranges
            .iter()
            .flat_map(|r| (0..r.len).map(move |i| (r.dst + i, r.src + i)))
            .collect();
        m.sort_unstable();
        m
    }

    #[test]
    fn coalescing_never_changes_which_byte_goes_where() {
        use proptest::prelude::*;
        let p = layout(0x10_0000, 1, 64, 16, (0, 1), 1);
        let c = layout(0x90_0000, 1, 64, 16, (0, 1), 1);
        let blocks = proptest::sample::subsequence((0u32..64).collect::<Vec<_>>(), 1..40)
            .prop_flat_map(|dst| {
                let n = dst.len();
                (
                    Just(dst),
                    proptest::sample::subsequence((0u32..64).collect::<Vec<_>>(), n),
                )
            })
            .prop_flat_map(|(dst, src)| (Just(dst).prop_shuffle(), Just(src).prop_shuffle(), any::<bool>()));
        proptest!(|((dst, src, rev) in blocks)| {
            let (mut src, mut dst) = (src, dst);
            if rev {
                // Runs in both directions, as a cycled vLLM pool gives them.
                src.sort_unstable_by(|a, b| b.cmp(a));
                dst.sort_unstable_by(|a, b| b.cmp(a));
            }
            let n = src.len() as u32;
            let mut merged = Vec::new();
            p.plan_layer(&c, 0, &src, &dst, 0..n, &mut merged).unwrap();
            let one_by_one: Vec<WriteRange> = src
                .iter()
                .zip(&dst)
                .map(|(&s, &d)| WriteRange { src: 0x10_0000 + s as u64 * 16, dst: 0x90_0000 + d as u64 * 16, len: 16 })
                .collect();
            prop_assert_eq!(byte_map(&merged), byte_map(&one_by_one));
            prop_assert!(merged.len() <= src.len());
            if rev {
                prop_assert_eq!(merged.len(), 1 + src.windows(2).zip(dst.windows(2))
                    .filter(|(s, d)| !(s[0] == s[1] + 1 && d[0] == d[1] + 1)).count());
            }
        });
    }

    #[test]
    fn two_producers_write_their_head_halves() {
        // consumer TP 1 holds 4 heads (block 256 B = 4 x 64 B); producers TP 2 hold 2 heads each.
        let c = layout(0x90_0000, 1, 4, 256, (0, 1), 4);
        let p0 = layout(0x10_0000, 1, 4, 128, (0, 2), 4);
        let p1 = layout(0x20_0000, 1, 4, 128, (1, 2), 4);
        assert_eq!(c.expected_producers(2), 2);
        for (rank, p) in [p0, p1].iter().enumerate() {
            p.check_compatible(&c).unwrap();
            let mut out = Vec::new();
            p.plan_layer(&c, 0, &[0, 1], &[2, 3], 0..2, &mut out).unwrap();
            let off = rank as u64 * 128;
            assert_eq!(
                out,
                vec![
                    WriteRange {
                        src: p.layers[0].planes[0].base,
                        dst: 0x90_0000 + 2 * 256 + off,
                        len: 128
                    },
                    WriteRange {
                        src: p.layers[0].planes[0].base + 128,
                        dst: 0x90_0000 + 3 * 256 + off,
                        len: 128
                    },
                ]
            );
        }
    }

    #[test]
    fn index_outside_authorization_is_an_error_not_a_write() {
        let p = layout(0x10_0000, 1, 8, 256, (0, 1), 2);
        let c = layout(0x90_0000, 1, 8, 256, (0, 1), 2);
        let mut out = Vec::new();
        let err = p
            .plan_layer(&c, 0, &[0, 1, 2], &[4, 5], 0..3, &mut out)
            .unwrap_err();
        assert!(matches!(
            err,
            GeometryError::OutsideAuthorization {
                index: 2,
                authorized: 2
            }
        ));
        assert!(out.is_empty());
    }

    #[test]
    fn mismatched_geometry_is_rejected() {
        let p = layout(0x10_0000, 2, 8, 256, (0, 1), 2);
        let c = layout(0x90_0000, 3, 8, 256, (0, 1), 2);
        assert!(matches!(
            p.check_compatible(&c),
            Err(GeometryError::LayerCount { .. })
        ));
        let c = layout(0x90_0000, 2, 8, 512, (0, 1), 2);
        assert!(matches!(
            p.check_compatible(&c),
            Err(GeometryError::HeadBytes { .. })
        ));
        let c = layout(0x90_0000, 2, 8, 256, (0, 1), 4);
        assert!(matches!(
            p.check_compatible(&c),
            Err(GeometryError::TensorParallel(_))
        ));
    }
}
