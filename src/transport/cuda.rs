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
// SAFETY: as above: sharing a handle only shares the identifier; every use
// goes through the driver (a stream is used by one caller at a time, taken
// from its pool).
unsafe impl Sync for Handle {}

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
            *context = Some(current_context("records layer events")?);
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
        with_context(self.context, f)
    }
}

impl Drop for GpuMark {
    fn drop(&mut self) {
        if let Some(ev) = self.event.take() {
            self.pool.lock().push(ev);
        }
    }
}

/// The gather kernel's PTX (`shim/gather_kernel.cu`, compiled by
/// `scripts/gen_gather_ptx.sh`), JIT-compiled by the driver for the GPU it
/// runs on.
const GATHER_PTX: &str = concat!(include_str!("shim/gather_kernel.ptx"), "\0");

/// How a [`CudaCopier`] copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaCopyPath {
    /// OrbitKV's gather kernel on the SMs, one launch a write, on a stream
    /// of the highest priority.
    Kernel,
    /// The copy engines: CUDA 13's `cuMemcpyBatchAsync`, one call per 1024
    /// ranges.
    BatchCopy,
    /// The copy engines, one `cuMemcpyAsync` per range (a driver without
    /// the batch call).
    CopyPerRange,
}

impl CudaCopyPath {
    /// The words the worker's log and the binding use.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Kernel => "gather kernel",
            Self::BatchCopy => "cuMemcpyBatchAsync",
            Self::CopyPerRange => "cuMemcpyAsync per range",
        }
    }
}

/// A stream of a [`CudaCopier`] and, for the kernel, its device buffer for
/// the list of copies (grown by the shim; 0 / 0 until the first launch).
#[derive(Debug)]
struct CopyStream {
    stream: Handle,
    list: u64,
    list_bytes: usize,
}

/// Copies on the GPU for a writer lane's gather (`orbitkv.pd.staging_pieces`
/// `write`): device-to-device copies on streams of its own, in the CUDA
/// context of the worker that made it, each waited for before it returns;
/// with the gather kernel where it loaded, else on the copy engines.
#[derive(Debug)]
pub struct CudaCopier {
    context: Handle,
    /// The loaded kernel module and its function, when the path is the
    /// kernel.
    kernel: Option<(Handle, Handle)>,
    /// Why the kernel is not used (it failed to load), for the log.
    kernel_error: Option<String>,
    /// Streams not in use; a copy takes one (or makes one) and puts it back.
    streams: Mutex<Vec<CopyStream>>,
}

impl CudaCopier {
    /// Loads the CUDA driver and takes the calling thread's current
    /// context (the vLLM worker's, where its KV cache lives). With `kernel`,
    /// loads the gather kernel there (falling back to the copy engines, the
    /// reason kept, when it does not load). Fails with
    /// [`TransportError::Cuda`] without a driver or a current context.
    pub fn for_current_context(kernel: bool) -> TransportResult<Self> {
        // SAFETY: loads libcuda.so.1 and resolves symbols; no pointers passed.
        if unsafe { ffi::okv_cuda_load() } != 0 {
            return Err(cuda_err());
        }
        let context = current_context("set up the writer's gather")?;
        let (loaded, kernel_error) = if kernel {
            let mut module: *mut c_void = std::ptr::null_mut();
            let mut function: *mut c_void = std::ptr::null_mut();
            // SAFETY: GATHER_PTX is NUL-terminated and static; the two
            // out-pointers are valid for the call; the module is loaded into
            // the calling thread's current context (checked above).
            let rc =
                unsafe { ffi::okv_cuda_gather_load(GATHER_PTX.as_ptr().cast(), &mut module, &mut function) };
            if rc == 0 {
                (Some((Handle(module), Handle(function))), None)
            } else {
                (None, Some(ffi::last_error()))
            }
        } else {
            (None, None)
        };
        Ok(Self {
            context,
            kernel: loaded,
            kernel_error,
            streams: Mutex::new(Vec::new()),
        })
    }

    /// How it copies.
    pub fn path(&self) -> CudaCopyPath {
        if self.kernel.is_some() {
            return CudaCopyPath::Kernel;
        }
        // SAFETY: reads a flag the shim set when it loaded the driver.
        if unsafe { ffi::okv_cuda_has_batch_copy() } == 1 {
            CudaCopyPath::BatchCopy
        } else {
            CudaCopyPath::CopyPerRange
        }
    }

    /// Why the gather kernel, asked for, did not load (`None` when it did
    /// or was not asked for).
    pub fn kernel_error(&self) -> Option<&str> {
        self.kernel_error.as_deref()
    }

    /// Copies every range (`src` to `dst`, `len` bytes; device or unified
    /// addresses of this context) and returns once the GPU ran the copies.
    /// The calling thread's current context is the same after.
    pub fn copy(&self, ranges: &[crate::transport::WriteRange]) -> TransportResult<()> {
        if ranges.is_empty() {
            return Ok(());
        }
        let dst: Vec<u64> = ranges.iter().map(|r| r.dst).collect();
        let src: Vec<u64> = ranges.iter().map(|r| r.src).collect();
        let len: Vec<u64> = ranges.iter().map(|r| r.len).collect();
        with_context(self.context, || {
            let mut slot = match self.streams.lock().pop() {
                Some(s) => s,
                None => {
                    let mut s: *mut c_void = std::ptr::null_mut();
                    // SAFETY: s is a valid out-pointer; the stream is made in
                    // the context made current above.
                    let rc = unsafe {
                        if self.kernel.is_some() {
                            ffi::okv_cuda_stream_new_urgent(&mut s)
                        } else {
                            ffi::okv_cuda_stream_new(&mut s)
                        }
                    };
                    if rc != 0 {
                        return None;
                    }
                    CopyStream {
                        stream: Handle(s),
                        list: 0,
                        list_bytes: 0,
                    }
                }
            };
            let rc = match self.kernel {
                // SAFETY: the three arrays hold `ranges.len()` entries each
                // and outlive the call, which waits for the kernel; the
                // function is this copier's, loaded in this context; the
                // stream and its list buffer are the slot's, used by one
                // caller at a time (taken from the pool), and the shim grows
                // the buffer through the two pointers. The addresses are the
                // caller's to vouch for.
                Some((_, function)) => unsafe {
                    ffi::okv_cuda_gather_wait(
                        function.0,
                        slot.stream.0,
                        &mut slot.list,
                        &mut slot.list_bytes,
                        dst.as_ptr(),
                        src.as_ptr(),
                        len.as_ptr(),
                        dst.len(),
                    )
                },
                // SAFETY: as above, for the copy engines' call (no buffer).
                None => unsafe {
                    ffi::okv_cuda_copy_wait(
                        slot.stream.0,
                        dst.as_ptr(),
                        src.as_ptr(),
                        len.as_ptr(),
                        dst.len(),
                    )
                },
            };
            self.streams.lock().push(slot);
            (rc == 0).then_some(())
        })
    }
}

impl Drop for CudaCopier {
    fn drop(&mut self) {
        let streams = std::mem::take(&mut *self.streams.lock());
        let kernel = self.kernel.take();
        if streams.is_empty() && kernel.is_none() {
            return;
        }
        let _ = with_context(self.context, || {
            for s in streams {
                // SAFETY: a stream this copier made, idle (every copy waited
                // for its own), destroyed once; its list buffer (0: none) was
                // allocated by the shim in this context and is freed once.
                unsafe {
                    ffi::okv_cuda_stream_free(s.stream.0);
                    if s.list != 0 {
                        ffi::okv_cuda_mem_free(s.list);
                    }
                }
            }
            if let Some((module, _)) = kernel {
                // SAFETY: the module this copier loaded, no launch of it
                // running (each waited for), unloaded once.
                unsafe { ffi::okv_cuda_module_free(module.0) };
            }
            Some(())
        });
    }
}

/// The calling thread's current CUDA context; a thread with none (one that
/// never touched the GPU) is an error naming what it did (`what`).
fn current_context(what: &str) -> TransportResult<Handle> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: ctx is a valid out-pointer for the call's duration.
    if unsafe { ffi::okv_cuda_current_context(&mut ctx) } != 0 {
        return Err(cuda_err());
    }
    if ctx.is_null() {
        return Err(TransportError::Cuda(format!(
            "no CUDA context is current on the thread that {what}"
        )));
    }
    Ok(Handle(ctx))
}

/// Runs `f` with `context` current on this thread, whose own context (if
/// any) is put back after; `f` says `None` when its driver call failed.
fn with_context<T>(context: Handle, f: impl FnOnce() -> Option<T>) -> TransportResult<T> {
    let mut prev: *mut c_void = std::ptr::null_mut();
    // SAFETY: prev is a valid out-pointer for the call's duration; the
    // context set is a live one (a thread may make any context current).
    unsafe {
        if ffi::okv_cuda_current_context(&mut prev) != 0 {
            return Err(cuda_err());
        }
        if prev != context.0 && ffi::okv_cuda_set_context(context.0) != 0 {
            return Err(cuda_err());
        }
    }
    let out = f().ok_or_else(cuda_err);
    if prev != context.0 {
        // SAFETY: the context that was current before (or none: null).
        unsafe { ffi::okv_cuda_set_context(prev) };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gather kernel's PTX is what the shim asks for: one entry point
    /// `okv_gather(copies: u64, n: u32)` (the shim passes a device pointer
    /// and a 32-bit count), PTX the driver can JIT (ISA 6.0, sm_70 and up),
    /// and the one NUL at its end that the driver reads to.
    #[test]
    fn the_gather_kernels_ptx_has_the_entry_point_the_shim_launches() {
        let body = GATHER_PTX.strip_suffix('\0').expect("NUL-terminated");
        assert!(!body.contains('\0'));
        assert!(
            body.starts_with("// Generated from gather_kernel.cu"),
            "not the generated file"
        );
        assert!(body.contains(".version 6.0") && body.contains(".target sm_70"));
        assert_eq!(body.matches(".entry").count(), 1);
        let params: Vec<&str> = body
            .split(".visible .entry okv_gather(")
            .nth(1)
            .expect("okv_gather is the entry point")
            .split(')')
            .next()
            .unwrap()
            .split(',')
            .map(str::trim)
            .collect();
        assert_eq!(
            params,
            [".param .u64 okv_gather_param_0", ".param .u32 okv_gather_param_1"]
        );
        // no stack: the 16-byte words stay in registers
        assert!(!body.contains(".local"));
    }

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
