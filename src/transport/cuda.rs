//! GPU events from the CUDA driver (`libcuda.so.1`, loaded on first use
//! through the shim), so that a layer's write is submitted only after the
//! kernel that wrote the layer ran, with the wait on a Rust thread: the vLLM
//! worker records an event on its stream and goes on; nothing waits under
//! Python's lock.
//!
//! Events are pooled: one is taken from the pool (or created) when the
//! worker records, and goes back once a layer writer waited for it (or saw
//! it reached).

use std::ffi::c_void;
use std::sync::Arc;

use parking_lot::Mutex;

use super::ffi;
use crate::error::{TransportError, TransportResult};

fn cuda_err() -> TransportError {
    TransportError::Cuda(ffi::last_error())
}

/// A raw `CUevent` or `CUcontext` handle.
#[derive(Debug, Clone, Copy)]
struct Handle(*mut c_void);

// SAFETY: CUDA driver handles are process-wide identifiers, valid on any
// thread; the driver serialises its own use of them.
unsafe impl Send for Handle {}

/// The events of one process's GPU worker: a pool, and the CUDA context they
/// belong to (the one current on the worker's thread when the first was made).
#[derive(Debug)]
pub struct CudaEvents {
    context: Mutex<Option<Handle>>,
    pool: Arc<Mutex<Vec<Handle>>>,
}

impl CudaEvents {
    /// Loads the CUDA driver. Fails with [`TransportError::Cuda`] on a
    /// machine without one.
    pub fn load() -> TransportResult<Self> {
        // SAFETY: loads libcuda.so.1 and resolves symbols; no pointers passed.
        if unsafe { ffi::okv_cuda_load() } != 0 {
            return Err(cuda_err());
        }
        Ok(Self {
            context: Mutex::new(None),
            pool: Arc::new(Mutex::new(Vec::new())),
        })
    }

    /// Records an event on `stream` (a `cudaStream_t`/`CUstream` handle of
    /// the calling thread's context; 0 is the legacy default stream) and
    /// returns it, to be waited for on another thread.
    pub fn record(&self, stream: u64) -> TransportResult<GpuMark> {
        let mut context = self.context.lock();
        if context.is_none() {
            let mut ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: ctx is a valid out-pointer for the call's duration.
            if unsafe { ffi::okv_cuda_current_context(&mut ctx) } != 0 {
                return Err(cuda_err());
            }
            if ctx.is_null() {
                return Err(TransportError::Cuda(
                    "no CUDA context is current on the thread that records layer events".into(),
                ));
            }
            *context = Some(Handle(ctx));
        }
        let ctx = context.expect("set above");
        drop(context);
        let event = match self.pool.lock().pop() {
            Some(e) => e,
            None => {
                let mut ev: *mut c_void = std::ptr::null_mut();
                // SAFETY: ev is a valid out-pointer; the event is made in the
                // calling thread's current context (checked above to exist).
                if unsafe { ffi::okv_cuda_event_new(&mut ev) } != 0 {
                    return Err(cuda_err());
                }
                Handle(ev)
            }
        };
        // SAFETY: `event` is a live event of this pool; `stream` is the
        // caller's stream handle, which the driver validates.
        if unsafe { ffi::okv_cuda_event_record(event.0, stream) } != 0 {
            let e = cuda_err();
            self.pool.lock().push(event);
            return Err(e);
        }
        Ok(GpuMark {
            event: Some(event),
            context: ctx,
            pool: self.pool.clone(),
        })
    }
}

impl Drop for CudaEvents {
    fn drop(&mut self) {
        let ctx = *self.context.lock();
        if let Some(ctx) = ctx {
            // SAFETY: the context the events were made in; each pooled event
            // is destroyed once (marks still out return theirs to a pool that
            // is then only freed with its Arc, leaking at most those events).
            unsafe {
                ffi::okv_cuda_set_context(ctx.0);
                for ev in self.pool.lock().drain(..) {
                    ffi::okv_cuda_event_free(ev.0);
                }
            }
        }
    }
}

/// A recorded event: the GPU work before it on its stream.
#[derive(Debug)]
pub struct GpuMark {
    event: Option<Handle>,
    context: Handle,
    pool: Arc<Mutex<Vec<Handle>>>,
}

impl GpuMark {
    /// Blocks the calling thread until the GPU ran the work recorded before
    /// this mark. The thread's current CUDA context is the same after.
    pub fn wait(&mut self) -> TransportResult<()> {
        let Some(ev) = self.event else { return Ok(()) };
        self.in_context(|| {
            // SAFETY: a live event owned by this mark, in the current context.
            let rc = unsafe { ffi::okv_cuda_event_wait(ev.0) };
            (rc == 0).then_some(())
        })
    }

    /// Without blocking: `Some(())` once the GPU ran the work before this
    /// mark, `None` while it runs.
    pub fn poll(&mut self) -> TransportResult<Option<()>> {
        let Some(ev) = self.event else { return Ok(Some(())) };
        self.in_context(|| {
            // SAFETY: a live event owned by this mark, in the current context.
            let rc = unsafe { ffi::okv_cuda_event_query(ev.0) };
            match rc {
                0 => Some(Some(())),
                1 => Some(None),
                _ => None,
            }
        })
    }

    /// Runs `f` with the event's context current on this thread (a writer
    /// lane's thread, whose own context, if any, is put back after); `f`
    /// says `None` when its driver call failed.
    fn in_context<T>(&self, f: impl FnOnce() -> Option<T>) -> TransportResult<T> {
        let mut prev: *mut c_void = std::ptr::null_mut();
        // SAFETY: prev is a valid out-pointer for the call's duration; the
        // context set is the one the event was made in (a thread may make
        // any context current).
        unsafe {
            if ffi::okv_cuda_current_context(&mut prev) != 0 {
                return Err(cuda_err());
            }
            if prev != self.context.0 && ffi::okv_cuda_set_context(self.context.0) != 0 {
                return Err(cuda_err());
            }
        }
        let out = f().ok_or_else(cuda_err);
        if prev != self.context.0 {
            // SAFETY: the context that was current before (or none: null).
            unsafe { ffi::okv_cuda_set_context(prev) };
        }
        out
    }
}

impl Drop for GpuMark {
    fn drop(&mut self) {
        if let Some(ev) = self.event.take() {
            self.pool.lock().push(ev);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a CUDA driver (CI), loading fails with a typed error that
    /// names the library, and nothing else is touched.
    #[test]
    fn load_without_a_driver_is_a_typed_error() {
        match CudaEvents::load() {
            Ok(_) => eprintln!("a CUDA driver is present here: nothing to check"),
            Err(TransportError::Cuda(msg)) => assert!(msg.contains("libcuda.so.1"), "{msg}"),
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
}
