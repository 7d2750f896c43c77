//! `ORBITKV_TRACE=path` turns the actor trace on for a binary that calls
//! `trace::init_from_env` (the library itself installs nothing), and the
//! runtime's shutdown writes the file. (Its own file: a process has one
//! global subscriber.)
//!
//! The transport here is a test double that refuses every write: the
//! request below is aborted before any write, so none is attempted.

use std::sync::Arc;

use orbitkv::testing::capability as cap;
use orbitkv::transport::fake::{FakeEnd, FakeTransport};
use orbitkv::{KvLayout, RequestId, Runtime, RuntimeConfig, RuntimeEvent};

/// The crate's transport test double, refusing every write.
fn null_transport() -> Arc<FakeTransport> {
    let t = FakeTransport::new("127.0.0.1:1");
    t.refuse_submits(Some("null transport".into()));
    t.end_with(FakeEnd::Fail("null transport".into()));
    Arc::new(t)
}

#[test]
fn the_runtime_installs_nothing_and_init_from_env_installs_the_trace() {
    let path = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("trace_env.json");
    let _ = std::fs::remove_file(&path);
    std::env::set_var(orbitkv::trace::TRACE_ENV, &path);
    let layout = KvLayout::packed(0x10_0000, 1, 4, 4096, (0, 1), 1);
    let mut rt = Runtime::start(null_transport(), layout.clone(), RuntimeConfig::default()).unwrap();
    assert!(
        !tracing::dispatcher::has_been_set(),
        "Runtime::start set a global subscriber: that is the embedding process's choice"
    );
    rt.shutdown();
    assert_eq!(orbitkv::trace::init_from_env(), Some(path.as_path()));
    assert_eq!(
        orbitkv::trace::init_from_env(),
        Some(path.as_path()),
        "once per process"
    );
    let mut rt = Runtime::start(null_transport(), layout, RuntimeConfig::default()).unwrap();
    let req = RequestId::new("env-req");
    rt.producer_open(req.clone(), vec![0, 1], cap(), 1).unwrap();
    rt.producer_abort(&req, "test").unwrap();
    let ev = rt
        .next_event(std::time::Duration::from_secs(10))
        .expect("released");
    assert!(matches!(ev, RuntimeEvent::ProducerReleased { .. }), "{ev:?}");
    rt.shutdown();

    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).expect("written")).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let lane = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "producer env-req r0")
        .expect("the request's lane")["tid"]
        .clone();
    let on_lane: Vec<&str> = events
        .iter()
        .filter(|e| e["tid"] == lane && e["ph"] == "X")
        .map(|e| e["name"].as_str().unwrap())
        .collect();
    assert_eq!(on_lane, ["request", "AbortRequest"]);
}
