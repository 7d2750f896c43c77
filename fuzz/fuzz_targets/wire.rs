//! Fuzzes everything `wire.rs` parses from the network, and what the
//! producer does with an admitted handshake: a consumer's handshake (HTTP
//! side channel), a cancel, a notice (Mooncake). For any input: no panic;
//! an accepted message round-trips; an accepted handshake that fits this
//! rank's layout plans writes only inside the blocks it authorizes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use orbitkv::wire::{Cancel, Handshake, Notice};
use orbitkv::KvLayout;

/// The producer's own layout (4 layers, 64 blocks of 4 KiB, TP 1 of 2 heads).
fn local() -> KvLayout {
    KvLayout::packed(0x1000_0000, 4, 64, 4096, (0, 1), 2)
}

fuzz_target!(|data: &[u8]| {
    if let Ok(n) = Notice::from_json(data) {
        assert_eq!(Notice::from_json(&n.to_json()).unwrap(), n);
    }
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = Cancel::from_json(text) {
        assert_eq!(Cancel::from_json(&c.to_json()).unwrap(), c);
    }
    let Ok(h) = Handshake::from_json(text) else { return };
    assert_eq!(Handshake::from_json(&h.to_json()).unwrap(), h);
    let local = local();
    if local.check_compatible(&h.layout).is_err() {
        return;
    }
    // Plan every layer of the request's blocks as the producer would: every
    // range must lie inside one of the authorized destination blocks.
    let n = h.block_ids.len().min(local.num_blocks as usize) as u32;
    let src: Vec<u32> = (0..n).collect();
    let mut out = Vec::new();
    for layer in 0..local.layers.len() as u32 {
        out.clear();
        if local
            .plan_layer(&h.layout, layer, &src, &h.block_ids, 0..n, &mut out)
            .is_err()
        {
            continue;
        }
        let cl = &h.layout.layers[layer as usize];
        let blocks: Vec<(u64, u64)> = h.block_ids[..n as usize]
            .iter()
            .flat_map(|&b| {
                cl.planes
                    .iter()
                    .map(move |p| (p.block_addr(b), p.block_addr(b) + p.block_bytes))
            })
            .collect();
        for r in &out {
            // A coalesced range may span adjacent authorized blocks: walk it.
            let (mut at, end) = (r.dst, r.dst + r.len);
            while at < end {
                match blocks.iter().find(|&&(s, e)| at >= s && at < e) {
                    Some(&(_, e)) => at = e.min(end),
                    None => panic!("a planned range leaves the authorization: {r:?}"),
                }
            }
        }
    }
});
