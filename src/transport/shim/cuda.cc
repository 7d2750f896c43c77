// The shim's CUDA part (see mooncake.cc for the first, common.h for what they
// share): the few CUDA driver calls that order a layer's writes after the
// kernels that computed it.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "common.h"

using namespace okv;  // the shared helpers of common.h (and the loaded engine.so)

// ---- CUDA driver (libcuda.so.1), for ordering writes after the GPU ---------
//
// A prefill layer's KV is written by a kernel the vLLM worker launched; it
// may be written to decode only once that kernel ran. The worker records an
// event on its stream (okv_cuda_event_record, on its own thread) and the layer
// writer that carries the layer waits for it (okv_cuda_event_wait), with no
// Python lock held.
// The driver is loaded on first use; nothing here runs on a machine without
// CUDA unless called.

namespace {
using CUresult = int;
using CUctx = void*;
using CUev = void*;
using CUstream = void*;
struct CudaApi {
  CUresult (*ctx_get_current)(CUctx*) = nullptr;
  CUresult (*ctx_set_current)(CUctx) = nullptr;
  CUresult (*event_create)(CUev*, unsigned) = nullptr;
  CUresult (*event_record)(CUev, CUstream) = nullptr;
  CUresult (*event_synchronize)(CUev) = nullptr;
  CUresult (*event_query)(CUev) = nullptr;
  CUresult (*event_destroy)(CUev) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*memcpy_async)(uint64_t, uint64_t, size_t, CUstream) = nullptr;
  // CUDA 13's batch copy (optional: older drivers lack it).
  CUresult (*memcpy_batch)(uint64_t*, uint64_t*, size_t*, size_t, void*, size_t*, size_t,
                           CUstream) = nullptr;
  // The gather kernel (gather_kernel.cu, loaded from its PTX).
  CUresult (*module_load_data)(void**, const void*) = nullptr;
  CUresult (*module_get_function)(void**, void*, const char*) = nullptr;
  CUresult (*module_unload)(void*) = nullptr;
  CUresult (*launch_kernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            unsigned, CUstream, void**, void**) = nullptr;
  CUresult (*mem_alloc)(uint64_t*, size_t) = nullptr;
  CUresult (*mem_free)(uint64_t) = nullptr;
  CUresult (*memcpy_htod_async)(uint64_t, const void*, size_t, CUstream) = nullptr;
  CUresult (*stream_priority_range)(int*, int*) = nullptr;
  CUresult (*stream_create_priority)(CUstream*, unsigned, int) = nullptr;
};
// CUmemcpyAttributes (cuda.h, CUDA >= 12.8): the order the copies read their
// sources in, location hints (unused: 0), flags.
struct CopyAttributes {
  int src_access_order;
  int src_loc[2];
  int dst_loc[2];
  unsigned flags;
};
constexpr int kSrcAccessOrderStream = 0x1;  // CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
// Copies per batch call (the driver's limit is not documented).
constexpr size_t kBatchMax = 1024;
CudaApi g_cuda;
std::atomic<bool> g_cuda_loaded{false};
std::mutex g_cuda_mutex;
constexpr unsigned kEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING

int cuda_failed(const char* what, CUresult r) {
  const char* s = nullptr;
  if (g_cuda.get_error_string != nullptr) g_cuda.get_error_string(r, &s);
  set_error(std::string(what) + " returned CUDA error " + std::to_string(r) +
            (s != nullptr ? std::string(" (") + s + ")" : std::string()));
  return -1;
}

int cuda_not_loaded(const char* what) {
  set_error(std::string(what) + ": CUDA driver not loaded (call okv_cuda_load first)");
  return -1;
}
}  // namespace

extern "C" {

// Loads libcuda.so.1 and resolves the few driver functions used. Idempotent.
int okv_cuda_load() {
  return guarded("okv_cuda_load", [&]() -> int {
    std::lock_guard<std::mutex> lock(g_cuda_mutex);
    if (g_cuda_loaded.load()) return 0;
    void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      set_error(std::string("cannot load the CUDA driver libcuda.so.1: ") +
                (e != nullptr ? e : "?"));
      return -1;
    }
    const NamedSlot syms[] = {
        {"cuCtxGetCurrent", reinterpret_cast<void**>(&g_cuda.ctx_get_current)},
        {"cuCtxSetCurrent", reinterpret_cast<void**>(&g_cuda.ctx_set_current)},
        {"cuEventCreate", reinterpret_cast<void**>(&g_cuda.event_create)},
        {"cuEventRecord", reinterpret_cast<void**>(&g_cuda.event_record)},
        {"cuEventSynchronize", reinterpret_cast<void**>(&g_cuda.event_synchronize)},
        {"cuEventQuery", reinterpret_cast<void**>(&g_cuda.event_query)},
        {"cuEventDestroy_v2", reinterpret_cast<void**>(&g_cuda.event_destroy)},
        {"cuGetErrorString", reinterpret_cast<void**>(&g_cuda.get_error_string)},
        {"cuStreamCreate", reinterpret_cast<void**>(&g_cuda.stream_create)},
        {"cuStreamSynchronize", reinterpret_cast<void**>(&g_cuda.stream_synchronize)},
        {"cuStreamDestroy_v2", reinterpret_cast<void**>(&g_cuda.stream_destroy)},
        {"cuMemcpyAsync", reinterpret_cast<void**>(&g_cuda.memcpy_async)},
        {"cuModuleLoadData", reinterpret_cast<void**>(&g_cuda.module_load_data)},
        {"cuModuleGetFunction", reinterpret_cast<void**>(&g_cuda.module_get_function)},
        {"cuModuleUnload", reinterpret_cast<void**>(&g_cuda.module_unload)},
        {"cuLaunchKernel", reinterpret_cast<void**>(&g_cuda.launch_kernel)},
        {"cuMemAlloc_v2", reinterpret_cast<void**>(&g_cuda.mem_alloc)},
        {"cuMemFree_v2", reinterpret_cast<void**>(&g_cuda.mem_free)},
        {"cuMemcpyHtoDAsync_v2", reinterpret_cast<void**>(&g_cuda.memcpy_htod_async)},
        {"cuCtxGetStreamPriorityRange", reinterpret_cast<void**>(&g_cuda.stream_priority_range)},
        {"cuStreamCreateWithPriority", reinterpret_cast<void**>(&g_cuda.stream_create_priority)},
    };
    if (!resolve_all(h, syms, "libcuda.so.1")) return -1;
    // Optional: CUDA 13's signature (without failIdx); absent, copies go one
    // by one.
    g_cuda.memcpy_batch = reinterpret_cast<decltype(g_cuda.memcpy_batch)>(
        dlsym(h, "cuMemcpyBatchAsync_v2"));
    g_cuda_loaded.store(true);
    return 0;
  });
}

// The calling thread's current CUDA context (null when it has none).
int okv_cuda_current_context(void** ctx) {
  return guarded("okv_cuda_current_context", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_current_context");
    CUresult r = g_cuda.ctx_get_current(ctx);
    return r == 0 ? 0 : cuda_failed("cuCtxGetCurrent", r);
  });
}

int okv_cuda_set_context(void* ctx) {
  return guarded("okv_cuda_set_context", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_set_context");
    CUresult r = g_cuda.ctx_set_current(ctx);
    return r == 0 ? 0 : cuda_failed("cuCtxSetCurrent", r);
  });
}

// Creates an event (no timing) in the calling thread's current context.
int okv_cuda_event_new(void** ev) {
  return guarded("okv_cuda_event_new", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_event_new");
    CUresult r = g_cuda.event_create(ev, kEventDisableTiming);
    return r == 0 ? 0 : cuda_failed("cuEventCreate", r);
  });
}

// Records `ev` on `stream` (a CUstream / cudaStream_t handle; 0: the legacy
// default stream).
int okv_cuda_event_record(void* ev, uint64_t stream) {
  return guarded("okv_cuda_event_record", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_event_record");
    CUresult r = g_cuda.event_record(ev, reinterpret_cast<CUstream>(stream));
    return r == 0 ? 0 : cuda_failed("cuEventRecord", r);
  });
}

// Blocks the calling thread until the work before `ev` ran on the GPU.
int okv_cuda_event_wait(void* ev) {
  return guarded("okv_cuda_event_wait", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_event_wait");
    CUresult r = g_cuda.event_synchronize(ev);
    return r == 0 ? 0 : cuda_failed("cuEventSynchronize", r);
  });
}

// Without blocking: 0 once the work before `ev` ran, 1 while it runs, -1 on
// an error (the message set).
int okv_cuda_event_query(void* ev) {
  return guarded("okv_cuda_event_query", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_event_query");
    constexpr CUresult kNotReady = 600;  // CUDA_ERROR_NOT_READY
    CUresult r = g_cuda.event_query(ev);
    if (r == 0) return 0;
    if (r == kNotReady) return 1;
    return cuda_failed("cuEventQuery", r);
  });
}

int okv_cuda_event_free(void* ev) {
  return guarded("okv_cuda_event_free", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_event_free");
    CUresult r = g_cuda.event_destroy(ev);
    return r == 0 ? 0 : cuda_failed("cuEventDestroy", r);
  });
}

// ---- the writer's gather (orbitkv.pd.staging_pieces `write`) ---------------
//
// A writer lane copies a layer's scattered source bytes into one piece of
// the source staging region once the GPU computed the layer, on a stream of
// its own, and waits for the copy before Mooncake reads the piece: with the
// gather kernel (below) on the SMs, or on the copy engines (here) where the
// kernel did not load.

// Creates a non-blocking stream in the calling thread's current context.
int okv_cuda_stream_new(void** stream) {
  return guarded("okv_cuda_stream_new", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_stream_new");
    constexpr unsigned kNonBlocking = 0x1;  // CU_STREAM_NON_BLOCKING
    CUresult r = g_cuda.stream_create(reinterpret_cast<CUstream*>(stream), kNonBlocking);
    return r == 0 ? 0 : cuda_failed("cuStreamCreate", r);
  });
}

namespace {
// okv_cuda_copy_wait's body (also the gather kernel's fallback for copies
// that are not 16-byte multiples), inside its caller's guard.
int copy_engines_wait(CUstream s, const uint64_t* dst, const uint64_t* src, const uint64_t* len,
                      size_t n) {
  if (g_cuda.memcpy_batch != nullptr && n > 1) {
    // One driver call per kBatchMax copies; the arrays are read during
    // the call only. (The driver takes non-const pointers.)
    std::vector<size_t> sizes(len, len + n);
    CopyAttributes attrs{kSrcAccessOrderStream, {0, 0}, {0, 0}, 0};
    for (size_t at = 0; at < n; at += kBatchMax) {
      size_t k = n - at < kBatchMax ? n - at : kBatchMax;
      size_t first = 0;
      CUresult r = g_cuda.memcpy_batch(const_cast<uint64_t*>(dst + at), const_cast<uint64_t*>(src + at),
                                       sizes.data() + at, k, &attrs, &first, 1, s);
      if (r != 0) {
        g_cuda.stream_synchronize(s);
        return cuda_failed("cuMemcpyBatchAsync", r);
      }
    }
  } else {
    for (size_t i = 0; i < n; ++i) {
      CUresult r = g_cuda.memcpy_async(dst[i], src[i], static_cast<size_t>(len[i]), s);
      if (r != 0) {
        g_cuda.stream_synchronize(s);
        return cuda_failed("cuMemcpyAsync", r);
      }
    }
  }
  CUresult r = g_cuda.stream_synchronize(s);
  return r == 0 ? 0 : cuda_failed("cuStreamSynchronize", r);
}
}  // namespace

// Queues `n` copies (dst[i] <- src[i], len[i] bytes; unified addresses) on
// `stream`, then waits until the stream ran them. On an error the copies
// queued before it are still waited for (nothing is left running on memory
// the caller frees next).
int okv_cuda_copy_wait(void* stream, const uint64_t* dst, const uint64_t* src, const uint64_t* len,
                       size_t n) {
  return guarded("okv_cuda_copy_wait", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_copy_wait");
    return copy_engines_wait(reinterpret_cast<CUstream>(stream), dst, src, len, n);
  });
}

// 1 when the driver has CUDA 13's batch copy (one call per 1024 copies),
// 0 when copies go one by one, -1 before okv_cuda_load.
int okv_cuda_has_batch_copy() {
  if (!g_cuda_loaded.load()) return -1;
  return g_cuda.memcpy_batch != nullptr ? 1 : 0;
}

// ---- the gather kernel (gather_kernel.cu) ------------------------------
//
// The same gather on the SMs: one kernel launch a write, on a stream of the
// highest priority (its blocks go ahead of the compute kernels waiting for
// an SM), reading the copies from a device buffer of the stream's own.

// Loads the gather kernel from `ptx` (NUL-terminated PTX text, JIT-compiled
// by the driver for this GPU) into the calling thread's current context.
int okv_cuda_gather_load(const char* ptx, void** module, void** function) {
  return guarded("okv_cuda_gather_load", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_gather_load");
    CUresult r = g_cuda.module_load_data(module, ptx);
    if (r != 0) return cuda_failed("cuModuleLoadData (the gather kernel's PTX)", r);
    r = g_cuda.module_get_function(function, *module, "okv_gather");
    if (r != 0) {
      g_cuda.module_unload(*module);
      *module = nullptr;
      return cuda_failed("cuModuleGetFunction(okv_gather)", r);
    }
    return 0;
  });
}

int okv_cuda_module_free(void* module) {
  return guarded("okv_cuda_module_free", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_module_free");
    CUresult r = g_cuda.module_unload(module);
    return r == 0 ? 0 : cuda_failed("cuModuleUnload", r);
  });
}

// Creates a non-blocking stream of the context's highest priority.
int okv_cuda_stream_new_urgent(void** stream) {
  return guarded("okv_cuda_stream_new_urgent", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_stream_new_urgent");
    int least = 0;
    int greatest = 0;
    CUresult r = g_cuda.stream_priority_range(&least, &greatest);
    if (r != 0) return cuda_failed("cuCtxGetStreamPriorityRange", r);
    constexpr unsigned kNonBlocking = 0x1;  // CU_STREAM_NON_BLOCKING
    r = g_cuda.stream_create_priority(reinterpret_cast<CUstream*>(stream), kNonBlocking, greatest);
    return r == 0 ? 0 : cuda_failed("cuStreamCreateWithPriority", r);
  });
}

// Runs the gather kernel `function` over `n` copies (dst[i] <- src[i],
// len[i] bytes; device addresses) on `stream` and waits until it ran. A
// list with an address or length that is not a multiple of 16 bytes goes
// to the copy engines instead (okv_cuda_copy_wait's path).
// `*buf` / `*cap` are the stream's device buffer for the copies' list
// (24 bytes a copy) and its size: grown here when too small (both start at
// 0), freed by the caller with okv_cuda_mem_free. On an error after the
// launch the stream is still waited for.
int okv_cuda_gather_wait(void* function, void* stream, uint64_t* buf, size_t* cap,
                         const uint64_t* dst, const uint64_t* src, const uint64_t* len, size_t n) {
  return guarded("okv_cuda_gather_wait", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_gather_wait");
    if (n == 0) return 0;
    if (n > 0xFFFFFFFFull) {
      set_error("okv_cuda_gather_wait: more than 2^32 - 1 copies in one call");
      return -1;
    }
    CUstream s = reinterpret_cast<CUstream>(stream);
    uint64_t any = 0;
    for (size_t i = 0; i < n; ++i) any |= dst[i] | src[i] | len[i];
    if ((any & 15) != 0) return copy_engines_wait(s, dst, src, len, n);
    const size_t bytes = n * 3 * sizeof(uint64_t);
    if (*cap < bytes) {
      size_t want = *cap == 0 ? 4096 : *cap;
      while (want < bytes) want *= 2;
      if (*buf != 0) {
        g_cuda.mem_free(*buf);
        *buf = 0;
        *cap = 0;
      }
      CUresult r = g_cuda.mem_alloc(buf, want);
      if (r != 0) {
        *buf = 0;
        return cuda_failed("cuMemAlloc (the gather's copy list)", r);
      }
      *cap = want;
    }
    std::vector<uint64_t> list(n * 3);
    for (size_t i = 0; i < n; ++i) {
      list[3 * i] = dst[i];
      list[3 * i + 1] = src[i];
      list[3 * i + 2] = len[i];
    }
    // From pageable memory: the call returns once `list` was read.
    CUresult r = g_cuda.memcpy_htod_async(*buf, list.data(), bytes, s);
    if (r != 0) {
      g_cuda.stream_synchronize(s);
      return cuda_failed("cuMemcpyHtoDAsync (the gather's copy list)", r);
    }
    uint64_t list_arg = *buf;
    unsigned count = static_cast<unsigned>(n);
    void* args[] = {&list_arg, &count};
    // One block a copy, up to 65535 (blocks stride over the rest).
    constexpr unsigned kThreads = 512;
    constexpr size_t kMaxBlocks = 65535;
    unsigned blocks = static_cast<unsigned>(n < kMaxBlocks ? n : kMaxBlocks);
    r = g_cuda.launch_kernel(function, blocks, 1, 1, kThreads, 1, 1, 0, s, args, nullptr);
    if (r != 0) {
      g_cuda.stream_synchronize(s);
      return cuda_failed("cuLaunchKernel (okv_gather)", r);
    }
    r = g_cuda.stream_synchronize(s);
    return r == 0 ? 0 : cuda_failed("cuStreamSynchronize (okv_gather)", r);
  });
}

int okv_cuda_mem_free(uint64_t ptr) {
  return guarded("okv_cuda_mem_free", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_mem_free");
    CUresult r = g_cuda.mem_free(ptr);
    return r == 0 ? 0 : cuda_failed("cuMemFree", r);
  });
}

int okv_cuda_stream_free(void* stream) {
  return guarded("okv_cuda_stream_free", [&]() -> int {
    if (!g_cuda_loaded.load()) return cuda_not_loaded("okv_cuda_stream_free");
    CUresult r = g_cuda.stream_destroy(reinterpret_cast<CUstream>(stream));
    return r == 0 ? 0 : cuda_failed("cuStreamDestroy", r);
  });
}

}  // extern "C"

