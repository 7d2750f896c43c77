//! What the crate's own tests, scenario examples and benchmarks share (cargo
//! feature `testing`, which they turn on through the crate's dev-dependency
//! on itself): the transport test double, the test capability, a rank whose
//! KV cache is host memory registered with a real Mooncake engine, and a
//! bounded wait for a runtime event. Nothing here is part of the connector.

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use crate::transport::fake::{FakeEnd, FakeTransport};
use crate::{
    Capability, EngineConfig, KvLayout, MooncakeTransferEngine, Outcome, RequestId, Runtime, RuntimeConfig,
    RuntimeEvent,
};

/// The capability every request of a test shares (the proxy would give each
/// request its own).
pub fn capability() -> Capability {
    Capability::parse("0123456789abcdef0123456789abcdef").expect("a valid capability")
}

/// `notice` tagged under `capability` (the key issue 31's notices were
/// tagged with): what a client that sent both halves of a request, and so
/// holds its capability, can make. A consumer must not believe it.
pub fn tagged_under_capability(notice: crate::Notice, capability: &Capability) -> crate::Notice {
    notice.sign_with_raw_key(capability.as_str().as_bytes())
}

/// A producer and a consumer runtime of `layout` and `cfg` over the
/// transport test double (`FakeTransport`, no bytes moved): the producer's
/// transport holds every batch in flight until the test lets it end
/// (`hold(false)`). Returns (producer, its transport, consumer).
pub fn held_fake_pair(layout: &KvLayout, cfg: RuntimeConfig) -> (Runtime, Arc<FakeTransport>, Runtime) {
    let wire = Arc::new(FakeTransport::new("127.0.0.1:1"));
    wire.hold(true);
    let consumer = Runtime::start(
        Arc::new(FakeTransport::new("127.0.0.1:2")),
        layout.clone(),
        cfg.clone(),
    )
    .expect("consumer runtime");
    let producer = Runtime::start(wire.clone(), layout.clone(), cfg).expect("producer runtime");
    (producer, wire, consumer)
}

/// Opens `req` on both sides with the test capability: the consumer
/// authorizes `dst` (from block 0, one producer), the producer holds `src`;
/// returns the consumer's handshake for the test to hand over (as a struct
/// or as JSON, as it means to test).
pub fn open_both(
    producer: &Runtime,
    consumer: &Runtime,
    req: &RequestId,
    src: &[u32],
    dst: &[u32],
) -> crate::Handshake {
    let hs = consumer
        .consumer_open(req.clone(), capability(), 0, dst.to_vec(), 1)
        .expect("consumer_open");
    producer
        .producer_open(req.clone(), src.to_vec(), capability(), 1)
        .expect("producer_open");
    hs
}

/// A rank whose KV cache is host memory registered with its own real
/// Mooncake engine (TCP on 127.0.0.1), and its request runtime.
pub struct HostRank {
    pub mem: Vec<u8>,
    pub layout: KvLayout,
    pub runtime: Arc<Runtime>,
    /// The runtime's transport (its open segments, say).
    pub engine: Arc<MooncakeTransferEngine>,
}

/// `layers` × `blocks` blocks of `block_bytes` (the `(tp_rank, tp_size)`
/// share of `heads` KV heads), filled byte by byte by `fill`; a consumer
/// deadline of 20 s, the other settings `RuntimeConfig::default()`'s.
pub fn host_rank(
    layers: u32,
    blocks: u32,
    block_bytes: u64,
    tp: (u32, u32),
    heads: u32,
    fill: impl Fn(usize) -> u8,
) -> HostRank {
    host_rank_with(layers, blocks, block_bytes, tp, heads, fill, test_config())
}

/// A consumer deadline of 20 s, the other settings `RuntimeConfig::default()`'s.
fn test_config() -> RuntimeConfig {
    RuntimeConfig {
        consumer_timeout: Duration::from_secs(20),
        ..RuntimeConfig::default()
    }
}

/// `mem` (holding `layout`'s blocks) registered with a new real Mooncake
/// engine, and a runtime of `layout` and `cfg` on it.
fn start_rank(mem: Vec<u8>, layout: KvLayout, cfg: RuntimeConfig) -> HostRank {
    let engine = Arc::new(MooncakeTransferEngine::new(&EngineConfig::default()).expect("engine"));
    engine
        .register_memory(mem.as_ptr() as u64, mem.len() as u64, "cpu:0")
        .expect("register");
    let runtime = Arc::new(Runtime::start(engine.clone(), layout.clone(), cfg).expect("runtime"));
    HostRank {
        mem,
        layout,
        runtime,
        engine,
    }
}

/// [`host_rank`] with the runtime settings `cfg`.
pub fn host_rank_with(
    layers: u32,
    blocks: u32,
    block_bytes: u64,
    tp: (u32, u32),
    heads: u32,
    fill: impl Fn(usize) -> u8,
    cfg: RuntimeConfig,
) -> HostRank {
    let size = (layers as u64 * blocks as u64 * block_bytes) as usize;
    let mut mem: Vec<u8> = (0..size).map(fill).collect();
    let base = mem.as_mut_ptr() as u64;
    let layout = KvLayout::packed(base, layers, blocks, block_bytes, tp, heads);
    start_rank(mem, layout, cfg)
}

/// [`host_rank`] whose blocks hold `block_size` tokens in `order` (one
/// unit a head: vLLM's head-major layouts), block bytes following from it.
pub fn host_rank_tokens(
    layers: u32,
    blocks: u32,
    block_size: u32,
    order: crate::layout::TokenOrder,
    heads: u32,
    fill: impl Fn(usize) -> u8,
) -> HostRank {
    let unit: u64 = order
        .parts
        .iter()
        .map(|p| p.rows as u64 * block_size as u64 * p.token_bytes)
        .sum();
    let block_bytes = unit * order.units as u64;
    let size = (layers as u64 * blocks as u64 * block_bytes) as usize;
    let mut mem: Vec<u8> = (0..size).map(fill).collect();
    let base = mem.as_mut_ptr() as u64;
    let mut layout = KvLayout::packed(base, layers, blocks, block_bytes, (0, 1), heads);
    layout.block_size = block_size;
    layout.token_order = Some(order);
    start_rank(mem, layout, test_config())
}

/// A rank of vLLM's hybrid shape: `tensors` arrays of `blocks` blocks of
/// `block_bytes` in host memory (one head), and one layer for each
/// `(group, tensor)` of `layers`, in that order: layers of different groups
/// naming the same tensor share its memory, as vLLM's hybrid KV cache
/// manager shares one tensor between a layer of each group. Filled by
/// `fill`; a consumer deadline of 20 s.
pub fn host_rank_grouped(
    layers: &[(u32, u32)],
    tensors: u32,
    blocks: u32,
    block_bytes: u64,
    fill: impl Fn(usize) -> u8,
) -> HostRank {
    let size = (tensors as u64 * blocks as u64 * block_bytes) as usize;
    let mut mem: Vec<u8> = (0..size).map(fill).collect();
    let base = mem.as_mut_ptr() as u64;
    let mut layout = KvLayout::packed(base, tensors, blocks, block_bytes, (0, 1), 1);
    let planes: Vec<_> = layout.layers.iter().map(|l| l.planes.clone()).collect();
    layout.layers = layers
        .iter()
        .map(|&(group, tensor)| crate::LayerGeometry {
            planes: planes[tensor as usize].clone(),
            group,
        })
        .collect();
    start_rank(mem, layout, test_config())
}

/// The bytes of `layer`'s block `b` on `r`.
pub fn block(r: &HostRank, layer: u32, b: u32) -> &[u8] {
    let p = r.layout.layers[layer as usize].planes[0];
    let off = (p.block_addr(b) - r.mem.as_ptr() as u64) as usize;
    &r.mem[off..off + p.block_bytes as usize]
}

/// Waits until every producer of `request` on `rt` took its handshake
/// (`Runtime::producer_handshake` answers before the producer's actor took
/// it: a test that reads what the authorization decides, such as the
/// gather order, waits for it first); panics after 10 s.
pub fn wait_authorized(rt: &Runtime, request: &RequestId) {
    let until = Instant::now() + Duration::from_secs(10);
    while !rt.producer_authorized(request) {
        assert!(
            Instant::now() < until,
            "{request:?}: no producer took the handshake in 10 s"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
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

/// How `request`'s producer side on `rt` ended: waits for its
/// `ProducerReleased` (other events are dropped; panics after 30 s).
pub fn wait_released(rt: &Runtime, request: &RequestId) -> (Outcome, Option<String>) {
    let ev = wait_for(
        rt,
        "the producer's release",
        |e| matches!(e, RuntimeEvent::ProducerReleased { request: r, .. } if r == request),
    );
    match ev {
        RuntimeEvent::ProducerReleased { outcome, reason, .. } => (outcome, reason),
        other => unreachable!("wait_for returned {other:?}"),
    }
}
