//! Loading Mooncake's `engine.so` into the process (once), and the one
//! patch OrbitKV makes to it: Mooncake's submit-time stream wait taken off
//! the writer threads on CUDA. Where the library is found and which version
//! is accepted: [`super::library`].

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use super::ffi;
use super::library::{self, MooncakeLibrary};
use crate::error::{TransportError, TransportResult};

static LOADED: OnceLock<Result<MooncakeLibrary, TransportError>> = OnceLock::new();

/// Loads Mooncake once per process. Later calls return the first result.
pub fn load_mooncake(
    explicit: Option<&Path>,
    allow_version: Option<&str>,
) -> TransportResult<MooncakeLibrary> {
    LOADED
        .get_or_init(|| {
            // SAFETY: pure query of the process's symbol table.
            let has_python = unsafe { ffi::okv_process_has_python() } == 1;
            let (lib, libpython) = library::locate(explicit, !has_python)?;
            library::check_version(&lib, allow_version)?;
            let libpython = if has_python {
                None
            } else {
                Some(libpython.ok_or_else(|| TransportError::LibPythonNotFound {
                    reason: "no interpreter reported its LIBDIR/LDLIBRARY".into(),
                })?)
            };
            let engine_c =
                CString::new(lib.engine.as_os_str().as_bytes()).map_err(|_| TransportError::LoadFailed {
                    path: lib.engine.clone(),
                    reason: "path has a NUL byte".into(),
                })?;
            let py_c = match &libpython {
                Some(p) => Some(CString::new(p.as_os_str().as_bytes()).map_err(|_| {
                    TransportError::LibPythonNotFound {
                        reason: "path has a NUL byte".into(),
                    }
                })?),
                None => None,
            };
            // SAFETY: both pointers are valid NUL-terminated strings for the
            // duration of the call; the shim copies what it keeps.
            let rc = unsafe {
                ffi::okv_load(
                    engine_c.as_ptr(),
                    py_c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr()),
                )
            };
            match rc {
                0 => Ok(lib),
                2 => Err(TransportError::LibPythonNotFound {
                    reason: ffi::last_error(),
                }),
                _ => Err(TransportError::LoadFailed {
                    path: lib.engine.clone(),
                    reason: ffi::last_error(),
                }),
            }
        })
        .clone()
}

/// Takes Mooncake's submit-time wait on the caller's default stream off the
/// writer threads.
///
/// Mooncake 0.3.13.post1's intra-node NVLink transport records an event on
/// `cudaStreamPerThread` and waits for it at the start of every submit. That
/// stream is ordered after the legacy default stream, so a submit blocks its
/// writer until whatever the process queued there (and every blocking stream
/// ahead of it: vLLM's forward) has run; under load each batch waited
/// milliseconds. This points `engine.so`'s imported `cudaEventRecord` at a
/// shim function that records those events on an idle non-blocking stream of
/// the calling thread instead (`shim/submit_wait.cc`); every other record passes through.
///
/// Safe where the caller orders its writes after the GPU itself: OrbitKV
/// admits a GPU layer only after an event recorded behind its attention
/// kernel completed, and Mooncake's copies keep source access order on their
/// own stream. Loads Mooncake first (as [`load_mooncake`]); idempotent.
/// Returns the number of `engine.so` import slots redirected: 0 for a
/// Mooncake without CUDA (nothing to do).
pub fn redirect_submit_wait(explicit: Option<&Path>) -> TransportResult<u32> {
    load_mooncake(explicit, None)?;
    let mut patched: std::os::raw::c_int = 0;
    // SAFETY: `patched` is a valid out-pointer for the call; the shim only
    // rewrites engine.so's own import slots (under its lock) and catches
    // every C++ exception.
    if unsafe { ffi::okv_redirect_submit_wait(&mut patched) } != 0 {
        return Err(TransportError::Cuda(ffi::last_error()));
    }
    Ok(u32::try_from(patched).unwrap_or(0))
}

/// Events Mooncake recorded since [`redirect_submit_wait`]: `(redirected,
/// passed)`, on the writer's idle stream and unchanged.
pub fn submit_wait_counts() -> (u64, u64) {
    let (mut redirected, mut passed) = (0u64, 0u64);
    // SAFETY: two valid out-pointers; the shim reads two atomics.
    unsafe { ffi::okv_submit_wait_counts(&mut redirected, &mut passed) };
    (redirected, passed)
}
