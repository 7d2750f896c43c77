//! A rank whose KV cache is host memory registered with its own real
//! Mooncake engine (TCP on 127.0.0.1), and its request runtime: the fixture
//! of the runtime-level tests (`runtime_loopback.rs`, `layer_gate.rs`,
//! `side_channel_http.rs`).

#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::{EngineConfig, KvLayout, MooncakeTransferEngine, Runtime, RuntimeConfig, RuntimeEvent};

/// A rank's KV cache in host memory, registered with its own engine.
pub struct Rank {
    pub mem: Vec<u8>,
    pub layout: KvLayout,
    pub runtime: Arc<Runtime>,
}

/// `layers` × `blocks` blocks of `block_bytes` (the `(tp_rank, tp_size)`
/// share of `heads` KV heads), filled byte by byte by `fill`; a consumer
/// deadline of 20 s.
pub fn rank(
    layers: u32,
    blocks: u32,
    block_bytes: u64,
    tp: (u32, u32),
    heads: u32,
    fill: impl Fn(usize) -> u8,
) -> Rank {
    let size = (layers as u64 * blocks as u64 * block_bytes) as usize;
    let mut mem: Vec<u8> = (0..size).map(fill).collect();
    let base = mem.as_mut_ptr() as u64;
    let layout = KvLayout::packed(base, layers, blocks, block_bytes, tp, heads);
    let engine = Arc::new(MooncakeTransferEngine::new(&EngineConfig::default()).expect("engine"));
    engine
        .register_memory(base, size as u64, "cpu:0")
        .expect("register");
    let cfg = RuntimeConfig {
        consumer_timeout: Duration::from_secs(20),
        ..RuntimeConfig::default()
    };
    let runtime = Arc::new(Runtime::start(engine, layout.clone(), cfg).expect("runtime"));
    Rank { mem, layout, runtime }
}

/// The bytes of `layer`'s block `b` on `r`.
pub fn block(r: &Rank, layer: u32, b: u32) -> &[u8] {
    let p = r.layout.layers[layer as usize].planes[0];
    let off = (p.block_addr(b) - r.mem.as_ptr() as u64) as usize;
    &r.mem[off..off + p.block_bytes as usize]
}

/// The next event of `rt` that `pred` accepts (others are dropped); panics
/// naming `what` after 30 s.
pub fn wait_for(rt: &Runtime, what: &str, pred: impl Fn(&RuntimeEvent) -> bool) -> RuntimeEvent {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Some(ev) = rt.next_event(Duration::from_millis(100)) {
            if pred(&ev) {
                return ev;
            }
        }
    }
    panic!("timed out waiting for {what}");
}
