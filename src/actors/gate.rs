//! The layer gate: one thread per runtime that admits a prefill layer to
//! its request actors once the GPU has written it.
//!
//! On a GPU the vLLM worker hands over a layer when it *launched* the
//! kernels that write it; they may not have run yet. The worker records a
//! mark (a CUDA event) on its stream and queues the layer here; the gate
//! waits for each mark in order, then calls [`Runtime::layer_ready`] for
//! every request of that step (and [`Runtime::producer_finish`] after a
//! request's last layer). Nothing here holds Python's lock, so a busy
//! engine thread never delays a transfer, and the worker never waits.
//!
//! If a mark cannot be waited for (a CUDA error), the layer is never
//! admitted: its requests are aborted (their consumers are told, nothing
//! unwritten is reported as written).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{unbounded, Receiver, Sender};

use super::runtime::Runtime;
use crate::error::RuntimeError;
use crate::ids::RequestId;

/// Something to wait for before a layer may be sent.
pub trait Mark: Send {
    /// Blocks until the data the mark covers is written.
    fn wait(&mut self) -> Result<(), String>;
}

impl Mark for crate::transport::cuda::GpuMark {
    fn wait(&mut self) -> Result<(), String> {
        crate::transport::cuda::GpuMark::wait(self).map_err(|e| e.to_string())
    }
}

/// What the gate does for a request once the mark before it was reached.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateCall {
    /// [`Runtime::layer_ready`].
    Ready {
        request: RequestId,
        layer: u32,
        blocks: Range<u32>,
    },
    /// [`Runtime::producer_finish`] (after every layer queued before it).
    Finish { request: RequestId },
}

impl GateCall {
    pub(crate) fn request(&self) -> &RequestId {
        match self {
            Self::Ready { request, .. } | Self::Finish { request } => request,
        }
    }
}

struct Item {
    mark: Option<Box<dyn Mark>>,
    calls: Vec<GateCall>,
    queued: Instant,
}

/// The gate thread and its queue. Dropping it (or [`LayerGate::close`])
/// runs what is queued, then stops the thread.
pub struct LayerGate {
    tx: Option<Sender<Item>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for LayerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerGate")
            .field("open", &self.tx.is_some())
            .finish()
    }
}

impl LayerGate {
    /// Starts the gate thread for `runtime`.
    pub fn start(runtime: Arc<Runtime>) -> Self {
        let (tx, rx) = unbounded::<Item>();
        let thread = std::thread::Builder::new()
            .name("orbitkv-layer-gate".into())
            .spawn(move || run(&runtime, rx))
            .expect("spawn the layer gate thread");
        Self {
            tx: Some(tx),
            thread: Some(thread),
        }
    }

    /// Queues `calls`, to run once `mark` is reached (at once without one),
    /// after everything queued before.
    pub fn push(&self, mark: Option<Box<dyn Mark>>, calls: Vec<GateCall>) -> Result<(), RuntimeError> {
        let item = Item {
            mark,
            calls,
            queued: Instant::now(),
        };
        match &self.tx {
            Some(tx) if tx.send(item).is_ok() => Ok(()),
            _ => Err(RuntimeError::Stopped),
        }
    }

    /// Runs what is queued, then stops the thread.
    pub fn close(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for LayerGate {
    fn drop(&mut self) {
        self.close();
    }
}

fn run(rt: &Runtime, rx: Receiver<Item>) {
    for mut item in rx {
        let waited = match item.mark.as_mut() {
            Some(m) => m.wait(),
            None => Ok(()),
        };
        drop(item.mark.take()); // a GPU event goes back to its pool
        match waited {
            Ok(()) => {
                let lag = item.queued.elapsed();
                rt.note_layer_gate(lag, item.ready_calls());
                rt.gate_calls(item.calls);
            }
            Err(reason) => {
                // The layer may be unwritten: never send it; fail its requests.
                let mut seen = std::collections::HashSet::new();
                for call in &item.calls {
                    let request = call.request();
                    if seen.insert(request.clone()) {
                        tracing::warn!(request = %request, %reason, "layer gate: GPU wait failed, aborting");
                        let _ = rt.producer_abort(request, &format!("GPU event wait failed: {reason}"));
                    }
                }
            }
        }
    }
}

impl Item {
    fn ready_calls(&self) -> usize {
        self.calls
            .iter()
            .filter(|c| matches!(c, GateCall::Ready { .. }))
            .count()
    }
}
