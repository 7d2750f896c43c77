//! Raw declarations of the C shim in `shim/` (`mooncake.cc`, `cuda.cc`, `submit_wait.cc`). Only `mooncake.rs`, `loader.rs` and `cuda.rs` call these.

use std::ffi::{c_char, c_int, c_void};

/// Opaque engine handle owned by the shim.
#[repr(C)]
pub struct OkvEngine {
    _private: [u8; 0],
}

/// One WRITE: `len` bytes from local address `src` to remote address `dst`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OkvRange {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

pub type OkvNotifyCb = unsafe extern "C" fn(
    ctx: *mut c_void,
    name: *const c_char,
    name_len: usize,
    msg: *const c_char,
    msg_len: usize,
);

extern "C" {
    pub fn okv_last_error() -> *const c_char;
    pub fn okv_sizeof_transfer_request() -> usize;
    pub fn okv_process_has_python() -> c_int;
    pub fn okv_load(engine_path: *const c_char, libpython: *const c_char) -> c_int;
    pub fn okv_engine_new(
        bind_host: *const c_char,
        nics: *const *const c_char,
        n_nics: usize,
    ) -> *mut OkvEngine;
    pub fn okv_engine_free(e: *mut OkvEngine);
    pub fn okv_engine_endpoint(e: *mut OkvEngine, buf: *mut c_char, cap: usize) -> c_int;
    pub fn okv_register(e: *mut OkvEngine, addr: u64, len: u64, location: *const c_char) -> c_int;
    pub fn okv_unregister(e: *mut OkvEngine, addr: u64) -> c_int;
    pub fn okv_open_segment(e: *mut OkvEngine, name: *const c_char, out: *mut u64) -> c_int;
    pub fn okv_close_segment(e: *mut OkvEngine, seg: u64) -> c_int;
    pub fn okv_submit_write(
        e: *mut OkvEngine,
        seg: u64,
        ranges: *const OkvRange,
        n: usize,
        batch_out: *mut u64,
    ) -> c_int;
    pub fn okv_batch_status(e: *mut OkvEngine, batch: u64, state: *mut i32, bytes: *mut u64) -> c_int;
    pub fn okv_task_status(
        e: *mut OkvEngine,
        batch: u64,
        task: u64,
        state: *mut i32,
        bytes: *mut u64,
    ) -> c_int;
    pub fn okv_free_batch(e: *mut OkvEngine, batch: u64) -> c_int;
    pub fn okv_send_notify(
        e: *mut OkvEngine,
        peer: *const c_char,
        name: *const c_char,
        name_len: usize,
        msg: *const c_char,
        msg_len: usize,
    ) -> c_int;
    pub fn okv_take_notifies(e: *mut OkvEngine, cb: OkvNotifyCb, ctx: *mut c_void) -> c_int;

    // CUDA driver (libcuda.so.1, loaded on first use): see `cuda.rs`.
    pub fn okv_cuda_load() -> c_int;
    pub fn okv_cuda_current_context(ctx: *mut *mut c_void) -> c_int;
    pub fn okv_cuda_set_context(ctx: *mut c_void) -> c_int;
    pub fn okv_cuda_event_new(ev: *mut *mut c_void) -> c_int;
    pub fn okv_cuda_event_record(ev: *mut c_void, stream: u64) -> c_int;
    pub fn okv_cuda_event_wait(ev: *mut c_void) -> c_int;
    pub fn okv_cuda_event_query(ev: *mut c_void) -> c_int;
    pub fn okv_cuda_event_free(ev: *mut c_void) -> c_int;
    pub fn okv_cuda_stream_new(stream: *mut *mut c_void) -> c_int;
    pub fn okv_cuda_copy_wait(
        stream: *mut c_void,
        dst: *const u64,
        src: *const u64,
        len: *const u64,
        n: usize,
    ) -> c_int;
    pub fn okv_cuda_stream_free(stream: *mut c_void) -> c_int;
    pub fn okv_cuda_has_batch_copy() -> c_int;
    pub fn okv_cuda_gather_load(
        ptx: *const c_char,
        module: *mut *mut c_void,
        function: *mut *mut c_void,
    ) -> c_int;
    pub fn okv_cuda_module_free(module: *mut c_void) -> c_int;
    pub fn okv_cuda_stream_new_urgent(stream: *mut *mut c_void) -> c_int;
    #[allow(clippy::too_many_arguments)]
    pub fn okv_cuda_gather_wait(
        function: *mut c_void,
        stream: *mut c_void,
        buf: *mut u64,
        cap: *mut usize,
        dst: *const u64,
        src: *const u64,
        len: *const u64,
        n: usize,
    ) -> c_int;
    pub fn okv_cuda_mem_free(ptr: u64) -> c_int;

    // Mooncake's submit-time wait on the caller's default stream: see
    // `mooncake.rs`, `redirect_submit_wait`.
    pub fn okv_redirect_submit_wait(patched: *mut c_int) -> c_int;
    pub fn okv_submit_wait_counts(redirected: *mut u64, passed: *mut u64);
}

/// The message the shim stored for the last failed call on this thread.
pub fn last_error() -> String {
    // SAFETY: okv_last_error returns a pointer into a thread-local std::string
    // that stays valid until the next shim call on this thread; we copy it out
    // immediately.
    unsafe {
        let p = okv_last_error();
        if p.is_null() {
            return String::from("unknown error");
        }
        std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_layout_matches_mooncake() {
        // SAFETY: a pure function of the compiled shim, no pointers involved.
        let size = unsafe { okv_sizeof_transfer_request() };
        assert_eq!(size, 56, "Transport::TransferRequest must be 56 bytes");
        assert_eq!(std::mem::size_of::<OkvRange>(), 24);
    }
}
