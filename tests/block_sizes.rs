//! Prefill and decode of different block sizes (issue 47): the planner cuts
//! the tokens decode loads where either side's block ends and writes each
//! piece row by row of the blocks' token order. Checked here byte for byte
//! against a model of both sides' memory: every token decode loads lands
//! where decode's layout keeps it, and no other byte of decode's memory
//! changes (nothing outside the authorized blocks, nor past the tokens).

// A test layout and a byte's address take every coordinate; the chunks a
// prefill reports are a list even when there is one.
#![allow(clippy::too_many_arguments, clippy::single_range_in_vec_init)]

use std::collections::HashMap;

use orbitkv::layout::{plan_write, KvLayout, Target, TokenOrder, TokenPart, WriteRange, HOLE};
use orbitkv::GeometryError;

/// A layout of `layers` layers, `blocks` blocks of `block_size` tokens,
/// `heads` of the model's `total` KV heads on this rank (TP `tp`), each
/// block `heads` units of `parts` (head-major, as vLLM's CPU and HND
/// layouts) or, with `token_major`, one unit holding every head per token
/// (NHD).
fn layout(
    base: u64,
    layers: u32,
    blocks: u32,
    block_size: u32,
    tp: (u32, u32),
    total: u32,
    parts: &[TokenPart],
    token_major: bool,
) -> KvLayout {
    let heads = total / tp.1;
    let unit: u64 = parts
        .iter()
        .map(|p| p.rows as u64 * block_size as u64 * p.token_bytes)
        .sum();
    let (units, parts) = if token_major {
        let widened = parts
            .iter()
            .map(|p| TokenPart {
                rows: p.rows,
                token_bytes: p.token_bytes * heads as u64,
            })
            .collect();
        (1, widened)
    } else {
        (heads, parts.to_vec())
    };
    let mut l = KvLayout::packed(base, layers, blocks, unit * heads as u64, tp, total);
    l.block_size = block_size;
    l.head_major = !token_major;
    l.token_order = Some(TokenOrder { units, parts });
    l.validate().unwrap();
    l
}

/// vLLM's CPU kernels: a head's K transposed (4 rows of one 2-byte element
/// a token), then its V (one row of 4 elements a token).
fn cpu_parts() -> Vec<TokenPart> {
    vec![
        TokenPart {
            rows: 4,
            token_bytes: 2,
        },
        TokenPart {
            rows: 1,
            token_bytes: 8,
        },
    ]
}

/// Where byte `i` of (unit `u`, part `k`, row `r`, token `t` of block `b`)
/// of layer `layer` lies in `l` (the token order written out).
fn addr(l: &KvLayout, layer: usize, b: u32, u: u32, k: usize, r: u32, t: u32, i: u64) -> u64 {
    let o = l.token_order.as_ref().unwrap();
    let bs = l.block_size as u64;
    let unit: u64 = o.parts.iter().map(|p| p.rows as u64 * bs * p.token_bytes).sum();
    let part: u64 = o.parts[..k]
        .iter()
        .map(|p| p.rows as u64 * bs * p.token_bytes)
        .sum();
    let tb = o.parts[k].token_bytes;
    l.layers[layer].planes[0].block_addr(b) + u as u64 * unit + part + (r as u64 * bs + t as u64) * tb + i
}

/// Memory of one side: every byte of every plane, source bytes numbered
/// (never 0), destination bytes 0.
fn memory(l: &KvLayout, fill: bool) -> HashMap<u64, u8> {
    let mut m = HashMap::new();
    for layer in &l.layers {
        for p in &layer.planes {
            for b in 0..l.num_blocks {
                for i in 0..p.block_bytes {
                    let a = p.block_addr(b) + i;
                    m.insert(a, if fill { (a % 251 + 1) as u8 } else { 0 });
                }
            }
        }
    }
    m
}

fn apply(src: &HashMap<u64, u8>, dst: &mut HashMap<u64, u8>, ranges: &[WriteRange]) {
    for r in ranges {
        for i in 0..r.len {
            let v = *src
                .get(&(r.src + i))
                .expect("a range reads outside the producer's planes");
            let slot = dst
                .get_mut(&(r.dst + i))
                .expect("a range writes outside the consumer's planes");
            *slot = v;
        }
    }
}

struct Case<'a> {
    p: &'a KvLayout,
    c: &'a KvLayout,
    src: &'a [u32],
    dst: &'a [u32],
    first_block: u32,
    tokens: u32,
}

impl Case<'_> {
    /// Plans every layer in the producer's `chunks` (request block ranges,
    /// as prefill reports them), applies the ranges, and checks every byte
    /// of the consumer: the loaded tokens of the heads both hold equal the
    /// producer's, every other byte is untouched. Returns the ranges a
    /// layer took, summed over the chunks.
    fn run(&self, chunks: &[std::ops::Range<u32>]) -> usize {
        let (mut sm, mut dm) = (memory(self.p, true), memory(self.c, false));
        let auth = Target {
            layout: self.c,
            block_ids: self.dst,
            first_block: self.first_block,
            tokens: self.tokens,
        };
        let mut out = Vec::new();
        let mut ranges = 0;
        for layer in 0..self.p.layers.len() as u32 {
            for chunk in chunks {
                plan_write(self.p, self.src, auth, layer, chunk.clone(), &mut out).unwrap();
                if layer == 0 {
                    ranges += out.len();
                }
                apply(&sm, &mut dm, &out);
            }
        }
        // Every byte the consumer should now hold, from where.
        let (pb, cb) = (self.p.block_size, self.c.block_size);
        let (ph, chs) = (self.p.heads_range(), self.c.heads_range());
        let order = self.c.token_order.as_ref().unwrap();
        let mut want: HashMap<u64, u8> = HashMap::new();
        let start = self.first_block * cb;
        for layer in 0..self.p.layers.len() {
            for t in start..self.tokens {
                let d = self.dst[(t / cb - self.first_block) as usize];
                if d == HOLE {
                    continue;
                }
                let s = self.src[(t / pb) as usize];
                for h in ph.start.max(chs.start)..ph.end.min(chs.end) {
                    for (k, part) in order.parts.iter().enumerate() {
                        // A token-major unit holds every head: one head's
                        // bytes are its slice of the token.
                        let (su, du, per, sh, dh) = if self.c.head_major {
                            (h - ph.start, h - chs.start, part.token_bytes, 0, 0)
                        } else {
                            let per = part.token_bytes / (chs.end - chs.start) as u64;
                            (
                                0,
                                0,
                                per,
                                (h - ph.start) as u64 * per,
                                (h - chs.start) as u64 * per,
                            )
                        };
                        for r in 0..part.rows {
                            for i in 0..per {
                                let from = addr(self.p, layer, s, su, k, r, t % pb, sh + i);
                                let to = addr(self.c, layer, d, du, k, r, t % cb, dh + i);
                                want.insert(to, sm[&from]);
                            }
                        }
                    }
                }
            }
        }
        for (a, v) in &dm {
            match want.get(a) {
                Some(w) => assert_eq!(v, w, "byte {a:#x} of the consumer holds the wrong token"),
                None => assert_eq!(
                    *v, 0,
                    "byte {a:#x} of the consumer was written but is not a loaded token"
                ),
            }
        }
        // Something was loaded, unless decode's blocks are holes.
        assert!(!want.is_empty() || self.dst.contains(&HOLE));
        sm.clear();
        ranges
    }
}

#[test]
fn cpu_blocks_of_4_tokens_fill_blocks_of_8_and_back_byte_for_byte() {
    let parts = cpu_parts();
    let small = layout(0x10_0000, 2, 16, 4, (0, 1), 2, &parts, false);
    let big = layout(0x80_0000, 2, 8, 8, (0, 1), 2, &parts, false);
    small.check_compatible(&big).unwrap();
    big.check_compatible(&small).unwrap();
    // 27 tokens: 7 blocks of 4 (the last one 3 tokens), 4 blocks of 8.
    let src4 = [3, 9, 4, 5, 12, 0, 7];
    let dst8 = [6, 1, 2, 7];
    Case {
        p: &small,
        c: &big,
        src: &src4,
        dst: &dst8,
        first_block: 0,
        tokens: 27,
    }
    .run(&[0..7]);
    // The other way; prefill reports its blocks in two chunks, the second
    // resending the partial block that ends the first.
    let src8 = [5, 0, 3, 6];
    let dst4 = [2, 15, 8, 9, 1, 0, 14];
    Case {
        p: &big,
        c: &small,
        src: &src8,
        dst: &dst4,
        first_block: 0,
        tokens: 27,
    }
    .run(&[0..2, 1..4]);
}

#[test]
fn a_local_prefix_hit_on_decode_and_sizes_that_do_not_divide_are_served() {
    let parts = cpu_parts();
    let p = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &parts, false);
    let c = layout(0x80_0000, 1, 8, 6, (0, 1), 2, &parts, false);
    // Decode holds its first 2 blocks (12 tokens): tokens 12..22 come, from
    // the middle of prefill block 3 on.
    Case {
        p: &p,
        c: &c,
        src: &[1, 2, 3, 4, 5, 6],
        dst: &[7, 0],
        first_block: 2,
        tokens: 22,
    }
    .run(&[0..6]);
}

#[test]
fn head_slices_of_tp_2_go_into_a_tp_1_block_of_another_size() {
    let parts = cpu_parts();
    let c = layout(0x80_0000, 2, 8, 8, (0, 1), 4, &parts, false);
    for rank in 0..2 {
        let p = layout(0x10_0000, 2, 16, 4, (rank, 2), 4, &parts, false);
        p.check_compatible(&c).unwrap();
        Case {
            p: &p,
            c: &c,
            src: &[1, 2, 3, 4],
            dst: &[5, 3],
            first_block: 0,
            tokens: 16,
        }
        .run(&[0..4]);
    }
}

#[test]
fn token_major_blocks_merge_into_one_range_per_run_of_blocks() {
    let row = [TokenPart {
        rows: 1,
        token_bytes: 8,
    }];
    let p = layout(0x10_0000, 2, 16, 4, (0, 1), 2, &row, true);
    let c = layout(0x80_0000, 2, 8, 16, (0, 1), 2, &row, true);
    p.check_compatible(&c).unwrap();
    // Prefill blocks 4..12 are consecutive, decode's two blocks are not:
    // one range per decode block.
    let ranges = Case {
        p: &p,
        c: &c,
        src: &[4, 5, 6, 7, 8, 9, 10, 11],
        dst: &[6, 2],
        first_block: 0,
        tokens: 32,
    }
    .run(&[0..8]);
    assert_eq!(ranges, 2);
}

#[test]
fn holes_are_skipped_where_decode_has_none_and_fail_where_it_needs_one() {
    let parts = cpu_parts();
    let p = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &parts, false);
    let c = layout(0x80_0000, 1, 8, 8, (0, 1), 2, &parts, false);
    // A decode hole (a sliding window's block out of the window): its
    // tokens are not written, the rest are.
    Case {
        p: &p,
        c: &c,
        src: &[HOLE, HOLE, 3, 4],
        dst: &[HOLE, 2],
        first_block: 0,
        tokens: 16,
    }
    .run(&[0..4]);
    let auth = Target {
        layout: &c,
        block_ids: &[1, 2],
        first_block: 0,
        tokens: 16,
    };
    let mut out = Vec::new();
    assert!(matches!(
        plan_write(&p, &[1, HOLE, 3, 4], auth, 0, 0..4, &mut out),
        Err(GeometryError::SourceReleased { index: 1, .. })
    ));
}

#[test]
fn tokens_outside_the_authorization_or_the_source_are_errors_never_writes() {
    let parts = cpu_parts();
    let p = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &parts, false);
    let c = layout(0x80_0000, 1, 8, 8, (0, 1), 2, &parts, false);
    let mut out = Vec::new();
    // Prefill's blocks past the tokens decode loads are not written.
    let auth = Target {
        layout: &c,
        block_ids: &[1, 2],
        first_block: 0,
        tokens: 10,
    };
    plan_write(&p, &[1, 2, 3, 4, 5, 6], auth, 0, 3..6, &mut out).unwrap();
    assert!(out.is_empty(), "{out:?}");
    // Tokens said beyond the authorized blocks: refused, nothing planned.
    let over = Target { tokens: 17, ..auth };
    assert!(matches!(
        plan_write(&p, &[1, 2, 3, 4, 5], over, 0, 0..5, &mut out),
        Err(GeometryError::OutsideAuthorization { .. })
    ));
    assert!(out.is_empty());
    // Fewer source blocks than the tokens decode loads.
    assert!(matches!(
        plan_write(&p, &[1, 2], auth, 0, 0..3, &mut out),
        Err(GeometryError::OutsideSource { .. })
    ));
    // No token count: refused.
    let unsaid = Target { tokens: 0, ..auth };
    assert!(matches!(
        plan_write(&p, &[1, 2, 3], unsaid, 0, 0..3, &mut out),
        Err(GeometryError::TokenOrder { .. })
    ));
}

#[test]
fn blocks_that_hold_their_tokens_differently_are_refused_with_the_reason() {
    let parts = cpu_parts();
    let p = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &parts, false);
    // Another block size, no token order (an older peer, an unknown kernel).
    let mut c = layout(0x80_0000, 1, 8, 8, (0, 1), 2, &parts, false);
    c.token_order = None;
    let err = p.check_compatible(&c).unwrap_err();
    assert!(
        matches!(
            err,
            GeometryError::TokenOrder {
                producer: 4,
                consumer: 8,
                ..
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("does not say how its blocks hold their tokens"),
        "{err}"
    );
    // Other rows (K not transposed): refused.
    let flat = [TokenPart {
        rows: 1,
        token_bytes: 16,
    }];
    let c = layout(0x80_0000, 1, 8, 8, (0, 1), 2, &flat, false);
    assert!(matches!(
        p.check_compatible(&c),
        Err(GeometryError::TokenOrder { .. })
    ));
    // The same block size, head-major on one side, token-major on the
    // other: the bytes of a block mean different things, refused too.
    let a = layout(0x10_0000, 1, 16, 8, (0, 1), 2, &flat, false);
    let b = layout(
        0x80_0000,
        1,
        8,
        8,
        (0, 1),
        2,
        &[TokenPart {
            rows: 1,
            token_bytes: 16,
        }],
        true,
    );
    assert!(matches!(
        a.check_compatible(&b),
        Err(GeometryError::TokenOrder { .. })
    ));
    // Head slices out of a token-major side: refused.
    let tp2 = layout(0x10_0000, 1, 16, 4, (0, 2), 4, &flat, true);
    let tp1 = layout(0x80_0000, 1, 8, 8, (0, 1), 4, &flat, false);
    assert!(tp2.check_compatible(&tp1).is_err());
}

#[test]
fn a_token_order_that_does_not_add_up_or_is_too_large_is_refused() {
    let mut l = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &cpu_parts(), false);
    l.token_order.as_mut().unwrap().parts[0].rows = 3;
    assert!(matches!(l.validate(), Err(GeometryError::BadPlane { .. })));
    let mut l = layout(0x10_0000, 1, 16, 4, (0, 1), 2, &cpu_parts(), false);
    l.token_order = Some(TokenOrder {
        units: 1,
        parts: vec![
            TokenPart {
                rows: 2048,
                token_bytes: 1
            };
            1
        ],
    });
    assert!(l.validate().is_err());
}

mod properties {
    //! Random block sizes, prompt lengths, decode prefix hits, tables with
    //! decode holes, prefill chunks (a partial block sent again), TP 1 and
    //! TP 2 → 1, both token orders: every byte of decode checked as above.

    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    struct Draw {
        pbs: u32,
        cbs: u32,
        tokens: u32,
        hit: u32,
        cpu: bool,
        tp2: bool,
        holes: Vec<bool>,
        cuts: Vec<u32>,
        shuffle: u64,
    }

    fn draw() -> impl Strategy<Value = Draw> {
        (
            (1u32..=24, 1u32..=24).prop_filter("sizes differ", |(p, c)| p != c),
            1u32..=80,
            0u32..=4,
            any::<bool>(),
            any::<bool>(),
            prop::collection::vec(prop::bool::weighted(0.2), 80),
            prop::collection::vec(0u32..=80, 0..4),
            any::<u64>(),
        )
            .prop_map(|((pbs, cbs), tokens, hit, cpu, tp2, holes, cuts, shuffle)| Draw {
                pbs,
                cbs,
                tokens,
                hit,
                cpu,
                tp2,
                holes,
                cuts,
                shuffle,
            })
    }

    /// `n` distinct block ids below `of`, in an order `seed` picks.
    fn ids(n: u32, of: u32, seed: u64) -> Vec<u32> {
        let mut v: Vec<u32> = (0..of).collect();
        let mut s = seed | 1;
        for i in (1..v.len()).rev() {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            v.swap(i, (s % (i as u64 + 1)) as usize);
        }
        v.truncate(n as usize);
        v
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn every_loaded_token_lands_where_decode_keeps_it_and_nothing_else_moves(d in draw()) {
            let parts = if d.cpu {
                cpu_parts()
            } else {
                vec![TokenPart { rows: 1, token_bytes: 8 }]
            };
            let (pb, cb, n) = (d.pbs, d.cbs, d.tokens);
            let src_n = n.div_ceil(pb);
            let first = d.hit.min((n - 1) / cb);
            let dst_n = n.div_ceil(cb) - first;
            let c = layout(0x80_0000, 2, dst_n + 3, cb, (0, 1), 2, &parts, !d.cpu);
            let mut dst = ids(dst_n, dst_n + 3, d.shuffle);
            for (i, b) in dst.iter_mut().enumerate() {
                if d.holes[i] {
                    *b = HOLE;
                }
            }
            // Prefill's steps: cut points in its blocks, each step from the
            // block the last one ended inside (sent again).
            let mut cuts: Vec<u32> = d.cuts.iter().map(|&x| x % (src_n + 1)).collect();
            cuts.push(src_n);
            cuts.sort_unstable();
            let mut chunks = Vec::new();
            let mut at = 0;
            for cut in cuts {
                if cut > at {
                    chunks.push(at.saturating_sub(1)..cut);
                    at = cut;
                }
            }
            let ranks: &[(u32, u32)] = if d.tp2 && d.cpu { &[(0, 2), (1, 2)] } else { &[(0, 1)] };
            for &tp in ranks {
                let heads = 2 * tp.1;
                let c = if tp.1 == 2 { layout(0x80_0000, 2, dst_n + 3, cb, (0, 1), heads, &parts, false) } else { c.clone() };
                let p = layout(0x10_0000, 2, src_n + 2, pb, tp, heads, &parts, !d.cpu);
                p.check_compatible(&c).unwrap();
                let src = ids(src_n, src_n + 2, d.shuffle.rotate_left(17));
                Case { p: &p, c: &c, src: &src, dst: &dst, first_block: first, tokens: n }.run(&chunks);
            }
        }
    }
}
