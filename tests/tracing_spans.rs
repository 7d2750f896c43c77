//! The actor trace, pinned: a request runs through a producer and a consumer
//! runtime over the real Mooncake engine on 127.0.0.1 with a Chrome trace
//! installed; the JSON written is parsed and its structure checked — one
//! lane per request actor, the root span holding one child span per handled
//! message, timestamps in order and properly nested.
//!
//! A process has one global subscriber, so this file holds one test.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use orbitkv::trace::ChromeTrace;
use orbitkv::{
    EngineConfig, Generation, KvLayout, MooncakeTransferEngine, Notice, Outcome, ProducerRank, RequestId,
    Runtime, RuntimeConfig, RuntimeEvent,
};
use serde_json::Value;

/// A rank's KV cache in host memory, registered with its own engine. The
/// runtime is declared first so it stops before the memory goes.
struct Rank {
    runtime: Runtime,
    _mem: Vec<u8>,
}

fn rank(layers: u32, blocks: u32, block_bytes: u64, fill: u8) -> Rank {
    let size = (layers as u64 * blocks as u64 * block_bytes) as usize;
    let mut mem = vec![fill; size];
    let base = mem.as_mut_ptr() as u64;
    let layout = KvLayout::packed(base, layers, blocks, block_bytes, (0, 1), 2);
    let engine = Arc::new(MooncakeTransferEngine::new(&EngineConfig::default()).expect("engine"));
    engine
        .register_memory(base, size as u64, "cpu:0")
        .expect("register");
    let runtime = Runtime::start(engine, layout, RuntimeConfig::default()).expect("runtime");
    Rank { runtime, _mem: mem }
}

use orbitkv::testing::{capability as cap, wait_for};

/// Float µs from the JSON; ends are compared with this much slack.
const EPS: f64 = 0.01;

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"))
}

#[test]
fn a_request_is_a_lane_per_actor_with_a_span_per_message() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("tracing_spans.json");
    let guard = ChromeTrace::install(&path).expect("install the trace");

    let layers = 4u32;
    let producer = rank(layers, 8, 4096, 0x11);
    let consumer = rank(layers, 8, 4096, 0xA5);
    let req = RequestId::new("req-trace");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![4, 5, 6], 1)
        .unwrap();
    producer
        .runtime
        .producer_open(req.clone(), vec![0, 1, 2], cap(), 1)
        .unwrap();
    // Layer 0 before the handshake (written when it arrives), the rest after.
    producer.runtime.layer_ready(&req, 0, 0..3).unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    for l in 1..layers {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    wait_for(&producer.runtime, "producer release", |e| {
        matches!(e, RuntimeEvent::ProducerReleased { .. })
    });
    let done = wait_for(&consumer.runtime, "consumer completion", |e| {
        matches!(
            e,
            RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
        )
    });
    assert!(matches!(done, RuntimeEvent::ConsumerCompleted { .. }), "{done:?}");

    // A stale notice: the router drops it, the consumer never sees it.
    let sender = MooncakeTransferEngine::new(&EngineConfig::default()).unwrap();
    let stale = Notice {
        version: orbitkv::wire::WIRE_VERSION,
        request_id: req.clone(),
        generation: Generation(hs.generation.0 - 1),
        producer_rank: ProducerRank(0),
        outcome: Outcome::Done,
        reason: None,
        bytes: 0,
        staged: false,
        mac: None,
    };
    sender
        .send_notification(consumer.runtime.endpoint(), "orbitkv", &stale.to_json())
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while consumer.runtime.stats().notices_stale_generation == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(consumer.runtime.stats().notices_stale_generation, 1);

    consumer.runtime.consumer_release(&req).unwrap();
    wait_for(&consumer.runtime, "consumer release", |e| {
        matches!(e, RuntimeEvent::ConsumerReleased { .. })
    });
    // Stopping the runtimes ends every actor, so every span is closed.
    drop(producer);
    drop(consumer);
    assert_eq!(guard.flush().expect("write the trace"), path);

    let trace: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).expect("valid JSON");
    let events = trace["traceEvents"].as_array().expect("traceEvents");
    assert_eq!(trace["otherData"]["dropped_events"], 0);
    assert_eq!(trace["otherData"]["open_requests"], 0);

    // Lanes, named by thread_name metadata.
    let lanes: HashMap<u64, String> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
        .map(|e| {
            (
                e["tid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().into(),
            )
        })
        .collect();
    let lane = |name: &str| -> u64 {
        let found: Vec<u64> = lanes
            .iter()
            .filter(|(_, n)| n.as_str() == name)
            .map(|(t, _)| *t)
            .collect();
        assert_eq!(found.len(), 1, "one lane named {name:?} in {lanes:?}");
        found[0]
    };
    let c_lane = lane(&format!("consumer req-trace g{}", hs.generation.0));
    let p_lane = lane("producer req-trace r0");

    // Timestamps never go back in file order.
    let ts: Vec<f64> = events
        .iter()
        .filter(|e| e["ph"] != "M")
        .map(|e| f(e, "ts"))
        .collect();
    assert!(ts.windows(2).all(|w| w[0] <= w[1]), "timestamps out of order");

    // Per lane: complete events properly nested, under exactly one root.
    let mut by_lane: BTreeMap<u64, Vec<&Value>> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        by_lane.entry(e["tid"].as_u64().unwrap()).or_default().push(e);
    }
    for (tid, spans) in &by_lane {
        let mut stack: Vec<(f64, f64)> = Vec::new();
        for s in spans {
            let (start, end) = (f(s, "ts"), f(s, "ts") + f(s, "dur"));
            while stack.last().is_some_and(|&(_, e)| start >= e - EPS) {
                stack.pop();
            }
            if let Some(&(ps, pe)) = stack.last() {
                assert!(
                    start >= ps - EPS && end <= pe + EPS,
                    "lane {} not nested: {s} inside [{ps}, {pe}]",
                    lanes[tid]
                );
            }
            stack.push((start, end));
        }
    }
    let lane_spans = |tid: u64| -> (Value, Vec<Value>) {
        let spans = &by_lane[&tid];
        let roots: Vec<&&Value> = spans.iter().filter(|s| s["cat"] == "request").collect();
        assert_eq!(roots.len(), 1, "one root span on lane {}", lanes[&tid]);
        let root = (*roots[0]).clone();
        assert_eq!(root["name"], "request");
        let (rs, re) = (f(&root, "ts"), f(&root, "ts") + f(&root, "dur"));
        let children: Vec<Value> = spans
            .iter()
            .filter(|s| s["cat"] != "request")
            .map(|s| (*s).clone())
            .collect();
        for c in &children {
            assert_eq!(c["cat"], "msg", "only message spans on a request lane: {c}");
            assert_eq!(c["args"]["request"], "req-trace", "inherited request: {c}");
            assert!(f(c, "ts") >= rs - EPS && f(c, "ts") + f(c, "dur") <= re + EPS);
        }
        (root, children)
    };
    let count = |spans: &[Value]| -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for s in spans {
            *m.entry(s["name"].as_str().unwrap().to_string()).or_default() += 1;
        }
        m
    };

    let (p_root, p_msgs) = lane_spans(p_lane);
    assert_eq!(p_root["args"]["side"], "producer");
    assert_eq!(p_root["args"]["request"], "req-trace");
    assert_eq!(p_root["args"]["rank"], 0);
    let n = layers as usize;
    let expected: BTreeMap<String, usize> = [
        ("HandshakeArrived", 1),
        ("LayerReady", n),
        ("LayerWritten", n),
        ("FinishRequest", 1),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    assert_eq!(count(&p_msgs), expected);
    let mut ready_layers: Vec<u64> = p_msgs
        .iter()
        .filter(|s| s["name"] == "LayerReady")
        .map(|s| s["args"]["layer"].as_u64().unwrap())
        .collect();
    ready_layers.sort();
    assert_eq!(ready_layers, (0..layers as u64).collect::<Vec<_>>());
    for s in p_msgs.iter().filter(|s| s["name"] == "LayerWritten") {
        assert_eq!(s["args"]["bytes"], 3 * 4096, "{s}");
    }

    let (c_root, c_msgs) = lane_spans(c_lane);
    assert_eq!(c_root["args"]["side"], "consumer");
    assert_eq!(c_root["args"]["generation"], hs.generation.0);
    let expected: BTreeMap<String, usize> = [("NoticeArrived", 1), ("ReleaseRequest", 1)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    assert_eq!(
        count(&c_msgs),
        expected,
        "the stale notice never reaches the actor"
    );

    // Events land as instants on the lane of the span they happened in.
    let instant = |name: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["ph"] == "i" && e["name"] == name)
            .collect()
    };
    assert_eq!(instant("notifying the consumer")[0]["tid"], p_lane);
    assert_eq!(instant("layer admitted").len(), n);
    assert!(instant("layer admitted").iter().all(|e| e["tid"] == p_lane));
    assert_eq!(instant("all producers done: KV complete")[0]["tid"], c_lane);
    let dropped = instant("notice for a stale generation dropped");
    assert_eq!(dropped.len(), 1);
    assert!(lanes[&dropped[0]["tid"].as_u64().unwrap()].starts_with("thread "));
    assert_eq!(dropped[0]["args"]["request"], "req-trace");

    // Writes in flight are async slices (b/e by id), one per layer write.
    let begins: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "b" && e["name"] == "write")
        .collect();
    assert_eq!(begins.len(), n);
    for b in begins {
        assert_eq!(b["args"]["result"], "ok");
        assert_eq!(b["args"]["request"], "req-trace");
        let end = events
            .iter()
            .find(|e| e["ph"] == "e" && e["id"] == b["id"])
            .expect("matching end");
        assert!(f(end, "ts") >= f(b, "ts"));
    }
    // The writer's submit calls sit on the writer's thread lane.
    let submits: Vec<&Value> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["name"] == "write_layer")
        .collect();
    assert_eq!(submits.len(), n);
    assert!(submits
        .iter()
        .all(|s| lanes[&s["tid"].as_u64().unwrap()].starts_with("thread ")));
}
