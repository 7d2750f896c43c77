// OrbitKV's C shim over the C++ API that Mooncake's `engine.so` exports.
//
// Mooncake ships no C API and no headers on any package registry; its wheels
// ship `mooncake/engine.so`, which exports the non-virtual members of
// `mooncake::TransferEngine` (C++11 string ABI). This file declares the few
// data types those members take *by value* exactly as Mooncake 0.3.13.post1
// lays them out, resolves the members with dlsym at run time, and offers them
// to Rust as plain C functions.
//
// Rules kept by every entry point below:
//   * no C++ exception crosses into Rust: each body runs inside `guarded`,
//     which catches everything and stores the message in a thread-local;
//   * a non-zero return means failure and `okv_last_error()` says why;
//   * pointers handed in are only read for the duration of the call.

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace mooncake {

// ---- Data types, declared as Mooncake 0.3.13.post1 declares them ----------

// `mooncake::Status`: final class, a uint16_t code (`enum class Code :
// uint16_t`, 6 bytes of padding) then a `const char*` message,
// user-declared destructor and copy/move constructors. Because it is not
// trivially copyable the Itanium ABI returns it through a hidden pointer;
// declaring the same shape here makes the compiler do the same.
class Status final {
 public:
  Status() noexcept : code_(0), message_(nullptr) {}
  ~Status() { delete[] message_; }
  Status(const Status& s) : code_(s.code_), message_(copy(s.message_)) {}
  Status(Status&& s) noexcept : code_(s.code_), message_(s.message_) {
    s.message_ = nullptr;
  }
  Status& operator=(const Status&) = delete;
  Status& operator=(Status&&) = delete;
  uint16_t code() const { return code_; }
  const char* message() const { return message_ ? message_ : ""; }

 private:
  static const char* copy(const char* m) {
    if (m == nullptr) return nullptr;
    size_t n = std::strlen(m) + 1;
    char* out = new char[n];
    std::memcpy(out, m, n);
    return out;
  }
  uint16_t code_;
  const char* message_;
};

namespace Transport {
enum OpCode : int32_t { READ = 0, WRITE = 1 };
struct TransferRequest {
  OpCode opcode;
  void* source;
  uint64_t target_id;
  uint64_t target_offset;
  size_t length;
  int advise_retry_cnt = 0;
  int transport_hint = 0;
  uint64_t task_group_id = 0;
};
// Mooncake's TransferStatusEnum is an int32_t-sized enum; the shim passes
// it through untouched, and its values are named once, on the Rust side
// (`mooncake::TransferStatus`).
using TransferStatusEnum = int32_t;
struct TransferStatus {
  TransferStatusEnum s;
  size_t transferred_bytes;
};
}  // namespace Transport

namespace TransferMetadata {
struct NotifyDesc {
  std::string name;
  std::string notify_msg;
};
}  // namespace TransferMetadata

// Opaque: only constructed, passed as `this`, and destroyed.
struct TransferEngine;

}  // namespace mooncake

static_assert(sizeof(mooncake::Status) == 16, "Status layout");
static_assert(sizeof(mooncake::Transport::TransferRequest) == 56,
              "TransferRequest layout");
static_assert(offsetof(mooncake::Transport::TransferRequest, source) == 8, "");
static_assert(offsetof(mooncake::Transport::TransferRequest, target_id) == 16, "");
static_assert(offsetof(mooncake::Transport::TransferRequest, target_offset) == 24, "");
static_assert(offsetof(mooncake::Transport::TransferRequest, length) == 32, "");
static_assert(offsetof(mooncake::Transport::TransferRequest, task_group_id) == 48, "");
static_assert(sizeof(mooncake::Transport::TransferStatus) == 16, "TransferStatus layout");
static_assert(sizeof(mooncake::TransferMetadata::NotifyDesc) == 64, "NotifyDesc layout");

namespace {

using mooncake::Status;
using mooncake::TransferEngine;
using mooncake::Transport::TransferRequest;
using mooncake::Transport::TransferStatus;
using mooncake::TransferMetadata::NotifyDesc;
using StrVec = std::vector<std::string>;

// Mooncake's object is 56 bytes (three shared_ptr and a bool) in 0.3.13.post1;
// we reserve more so that a larger object of a future build cannot overrun.
constexpr size_t kEngineStorage = 512;

// ---- Member function pointers, as plain functions with `this` first --------
using CtorBool = void (*)(TransferEngine*, bool);
using CtorBoolNics = void (*)(TransferEngine*, bool, const StrVec&);
using Dtor = void (*)(TransferEngine*);
using InitFn = int (*)(TransferEngine*, const std::string&, const std::string&,
                       const std::string&, uint64_t);
using GetIpPortFn = std::string (*)(TransferEngine*);
using OpenSegmentFn = uint64_t (*)(TransferEngine*, const std::string&);
using CloseSegmentFn = int (*)(TransferEngine*, uint64_t);
using RegisterFn = int (*)(TransferEngine*, void*, size_t, const std::string&,
                           bool, bool);
using UnregisterFn = int (*)(TransferEngine*, void*, bool);
using AllocBatchFn = uint64_t (*)(TransferEngine*, size_t);
using FreeBatchFn = Status (*)(TransferEngine*, uint64_t);
using SubmitFn = Status (*)(TransferEngine*, uint64_t,
                            const std::vector<TransferRequest>&);
using BatchStatusFn = Status (*)(TransferEngine*, uint64_t, TransferStatus&);
using TaskStatusFn = Status (*)(TransferEngine*, uint64_t, size_t,
                                TransferStatus&);
using GetNotifiesFn = int (*)(TransferEngine*, std::vector<NotifyDesc>&);
using SendNotifyFn = int (*)(TransferEngine*, std::string, NotifyDesc);

struct Api {
  CtorBool ctor_bool;
  CtorBoolNics ctor_bool_nics;
  Dtor dtor;
  InitFn init;
  GetIpPortFn get_local_ip_and_port;
  OpenSegmentFn open_segment;
  CloseSegmentFn close_segment;
  RegisterFn register_local_memory;
  UnregisterFn unregister_local_memory;
  AllocBatchFn allocate_batch_id;
  FreeBatchFn free_batch_id;
  SubmitFn submit_transfer;
  BatchStatusFn get_batch_transfer_status;
  TaskStatusFn get_transfer_status;
  GetNotifiesFn get_notifies;
  SendNotifyFn send_notify_by_name;
};

Api g_api;
void* g_engine_handle = nullptr;  // engine.so, kept open for the process
std::atomic<bool> g_loaded{false};
std::mutex g_load_mutex;

thread_local std::string t_last_error;

void set_error(std::string msg) { t_last_error = std::move(msg); }

// A function looked up by name into a slot.
struct NamedSlot {
  const char* name;
  void** slot;
};

// Resolves every entry of `slots` in `handle`; false (the error set, naming
// `what`) when one is missing.
template <size_t N>
bool resolve_all(void* handle, const NamedSlot (&slots)[N], const char* what) {
  for (const NamedSlot& s : slots) {
    *s.slot = dlsym(handle, s.name);
    if (*s.slot == nullptr) {
      set_error(std::string(what) + " lacks " + s.name);
      return false;
    }
  }
  return true;
}

// Runs `body`, converting every C++ exception into an error return.
template <typename F>
int guarded(const char* what, F&& body) noexcept {
  try {
    return body();
  } catch (const std::exception& e) {
    set_error(std::string(what) + ": C++ exception: " + e.what());
  } catch (...) {
    set_error(std::string(what) + ": unknown C++ exception");
  }
  return -1;
}

int not_loaded(const char* what) {
  set_error(std::string(what) + ": Mooncake library not loaded (call okv_load first)");
  return -1;
}

struct Symbol {
  const char* mangled;
  const char* readable;
  void** slot;
};

}  // namespace

struct okv_engine {
  alignas(64) unsigned char storage[kEngineStorage];
  TransferEngine* te() { return reinterpret_cast<TransferEngine*>(storage); }
};

struct okv_range {
  uint64_t src;
  uint64_t dst;
  uint64_t len;
};

typedef void (*okv_notify_cb)(void* ctx, const char* name, size_t name_len,
                              const char* msg, size_t msg_len);

extern "C" {

const char* okv_last_error(void) { return t_last_error.c_str(); }

size_t okv_sizeof_transfer_request(void) { return sizeof(TransferRequest); }

// 1 when the process already has Python's C API symbols (inside a Python
// interpreter, or after libpython was loaded RTLD_GLOBAL), else 0.
int okv_process_has_python(void) {
  return dlsym(RTLD_DEFAULT, "PyInstanceMethod_Type") != nullptr ? 1 : 0;
}

// Loads Mooncake's engine.so. When the process has no Python symbols (a pure
// Rust binary) and `libpython` is non-null, that library is loaded first with
// RTLD_GLOBAL so the Py* symbols engine.so references resolve.
int okv_load(const char* engine_path, const char* libpython) {
  return guarded("okv_load", [&]() -> int {
    std::lock_guard<std::mutex> lock(g_load_mutex);
    if (g_loaded.load()) return 0;
    if (dlsym(RTLD_DEFAULT, "PyInstanceMethod_Type") == nullptr) {
      if (libpython == nullptr || libpython[0] == '\0') {
        set_error(
            "this process has no Python runtime loaded and no libpython was "
            "given; Mooncake's engine.so is a Python extension and needs "
            "libpython's symbols");
        return 2;
      }
      if (dlopen(libpython, RTLD_NOW | RTLD_GLOBAL) == nullptr) {
        const char* e = dlerror();
        set_error(std::string("cannot load libpython '") + libpython +
                  "': " + (e ? e : "unknown dlopen error"));
        return 2;
      }
    }
    void* h = dlopen(engine_path, RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      const char* e = dlerror();
      set_error(std::string("cannot load '") + engine_path +
                "': " + (e ? e : "unknown dlopen error"));
      return 3;
    }
    Api api{};
    Symbol symbols[] = {
        {"_ZN8mooncake14TransferEngineC1Eb", "TransferEngine(bool)",
         reinterpret_cast<void**>(&api.ctor_bool)},
        {"_ZN8mooncake14TransferEngineC1EbRKSt6vectorINSt7__cxx1112basic_"
         "stringIcSt11char_traitsIcESaIcEEESaIS7_EE",
         "TransferEngine(bool, const vector<string>&)",
         reinterpret_cast<void**>(&api.ctor_bool_nics)},
        {"_ZN8mooncake14TransferEngineD1Ev", "~TransferEngine()",
         reinterpret_cast<void**>(&api.dtor)},
        {"_ZN8mooncake14TransferEngine4initERKNSt7__cxx1112basic_"
         "stringIcSt11char_traitsIcESaIcEEES8_S8_m",
         "TransferEngine::init", reinterpret_cast<void**>(&api.init)},
        {"_ZN8mooncake14TransferEngine17getLocalIpAndPortB5cxx11Ev",
         "TransferEngine::getLocalIpAndPort",
         reinterpret_cast<void**>(&api.get_local_ip_and_port)},
        {"_ZN8mooncake14TransferEngine11openSegmentERKNSt7__cxx1112basic_"
         "stringIcSt11char_traitsIcESaIcEEE",
         "TransferEngine::openSegment",
         reinterpret_cast<void**>(&api.open_segment)},
        {"_ZN8mooncake14TransferEngine12closeSegmentEm",
         "TransferEngine::closeSegment",
         reinterpret_cast<void**>(&api.close_segment)},
        {"_ZN8mooncake14TransferEngine19registerLocalMemoryEPvmRKNSt7__"
         "cxx1112basic_stringIcSt11char_traitsIcESaIcEEEbb",
         "TransferEngine::registerLocalMemory",
         reinterpret_cast<void**>(&api.register_local_memory)},
        {"_ZN8mooncake14TransferEngine21unregisterLocalMemoryEPvb",
         "TransferEngine::unregisterLocalMemory",
         reinterpret_cast<void**>(&api.unregister_local_memory)},
        {"_ZN8mooncake14TransferEngine15allocateBatchIDEm",
         "TransferEngine::allocateBatchID",
         reinterpret_cast<void**>(&api.allocate_batch_id)},
        {"_ZN8mooncake14TransferEngine11freeBatchIDEm",
         "TransferEngine::freeBatchID",
         reinterpret_cast<void**>(&api.free_batch_id)},
        {"_ZN8mooncake14TransferEngine14submitTransferEmRKSt6vectorINS_"
         "9Transport15TransferRequestESaIS3_EE",
         "TransferEngine::submitTransfer",
         reinterpret_cast<void**>(&api.submit_transfer)},
        {"_ZN8mooncake14TransferEngine22getBatchTransferStatusEmRNS_"
         "9Transport14TransferStatusE",
         "TransferEngine::getBatchTransferStatus",
         reinterpret_cast<void**>(&api.get_batch_transfer_status)},
        {"_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14"
         "TransferStatusE",
         "TransferEngine::getTransferStatus",
         reinterpret_cast<void**>(&api.get_transfer_status)},
        {"_ZN8mooncake14TransferEngine11getNotifiesERSt6vectorINS_"
         "16TransferMetadata10NotifyDescESaIS3_EE",
         "TransferEngine::getNotifies",
         reinterpret_cast<void**>(&api.get_notifies)},
        {"_ZN8mooncake14TransferEngine16sendNotifyByNameENSt7__cxx1112basic_"
         "stringIcSt11char_traitsIcESaIcEEENS_16TransferMetadata10NotifyDescE",
         "TransferEngine::sendNotifyByName",
         reinterpret_cast<void**>(&api.send_notify_by_name)},
    };
    for (const Symbol& s : symbols) {
      void* p = dlsym(h, s.mangled);
      if (p == nullptr) {
        set_error(std::string("symbol ") + s.readable + " (" + s.mangled +
                  ") not found in '" + engine_path + "'");
        dlclose(h);
        return 4;
      }
      *s.slot = p;
    }
    g_api = api;
    g_engine_handle = h;
    g_loaded.store(true);
    return 0;
  });
}

// Constructs and initializes an engine the way Mooncake's own Python binding
// does: auto discovery (RDMA where HCAs exist, restricted to `nics` when
// given, TCP otherwise), then `init("P2PHANDSHAKE", bind_host, "", 0)`.
okv_engine* okv_engine_new(const char* bind_host, const char* const* nics,
                           size_t n_nics) {
  okv_engine* out = nullptr;
  int rc = guarded("okv_engine_new", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_engine_new");
    okv_engine* e = new okv_engine();
    StrVec filter;
    for (size_t i = 0; i < n_nics; ++i) filter.emplace_back(nics[i]);
    if (filter.empty()) {
      g_api.ctor_bool(e->te(), true);
    } else {
      g_api.ctor_bool_nics(e->te(), true, filter);
    }
    int r;
    try {
      r = g_api.init(e->te(), std::string("P2PHANDSHAKE"),
                     std::string(bind_host), std::string(""), 0);
    } catch (...) {
      g_api.dtor(e->te());
      delete e;
      throw;
    }
    if (r != 0) {
      g_api.dtor(e->te());
      delete e;
      set_error("TransferEngine::init(P2PHANDSHAKE, '" +
                std::string(bind_host) + "') returned " + std::to_string(r));
      return -1;
    }
    out = e;
    return 0;
  });
  return rc == 0 ? out : nullptr;
}

void okv_engine_free(okv_engine* e) {
  guarded("okv_engine_free", [&]() -> int {
    if (e == nullptr || !g_loaded.load()) return 0;
    g_api.dtor(e->te());
    delete e;
    return 0;
  });
}

// Writes the local segment name (ip:port) into `buf` (NUL-terminated).
int okv_engine_endpoint(okv_engine* e, char* buf, size_t cap) {
  return guarded("okv_engine_endpoint", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_engine_endpoint");
    std::string s = g_api.get_local_ip_and_port(e->te());
    if (s.size() + 1 > cap) {
      set_error("endpoint longer than buffer");
      return -1;
    }
    std::memcpy(buf, s.c_str(), s.size() + 1);
    return 0;
  });
}

int okv_register(okv_engine* e, uint64_t addr, uint64_t len,
                 const char* location) {
  return guarded("okv_register", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_register");
    int r = g_api.register_local_memory(
        e->te(), reinterpret_cast<void*>(addr), static_cast<size_t>(len),
        std::string(location), true, true);
    if (r != 0) {
      set_error("TransferEngine::registerLocalMemory returned " +
                std::to_string(r));
      return -1;
    }
    return 0;
  });
}

int okv_unregister(okv_engine* e, uint64_t addr) {
  return guarded("okv_unregister", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_unregister");
    int r = g_api.unregister_local_memory(e->te(),
                                          reinterpret_cast<void*>(addr), true);
    if (r != 0) {
      set_error("TransferEngine::unregisterLocalMemory returned " +
                std::to_string(r));
      return -1;
    }
    return 0;
  });
}

int okv_open_segment(okv_engine* e, const char* name, uint64_t* out) {
  return guarded("okv_open_segment", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_open_segment");
    uint64_t id = g_api.open_segment(e->te(), std::string(name));
    // Mooncake returns (SegmentHandle)-1 when the peer cannot be opened.
    if (id == static_cast<uint64_t>(-1)) {
      set_error(std::string("TransferEngine::openSegment('") + name +
                "') failed: peer unreachable or not a Mooncake endpoint");
      return -1;
    }
    *out = id;
    return 0;
  });
}

int okv_close_segment(okv_engine* e, uint64_t seg) {
  return guarded("okv_close_segment", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_close_segment");
    return g_api.close_segment(e->te(), seg) == 0 ? 0 : -1;
  });
}

// Allocates a batch, submits `n` WRITE requests into segment `seg` and
// stores the batch id in `*batch_out`. On a submit failure the batch is freed.
// Submits a batch of WRITEs. 0: `*batch_out` is the batch; -1: failed
// before Mooncake answered (the error text says why); > 0: Mooncake's
// submitTransfer refused it with that `Status::Code`.
int okv_submit_write(okv_engine* e, uint64_t seg, const okv_range* ranges,
                     size_t n, uint64_t* batch_out) {
  return guarded("okv_submit_write", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_submit_write");
    std::vector<TransferRequest> reqs;
    reqs.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      TransferRequest r;
      r.opcode = mooncake::Transport::WRITE;
      r.source = reinterpret_cast<void*>(ranges[i].src);
      r.target_id = seg;
      r.target_offset = ranges[i].dst;
      r.length = static_cast<size_t>(ranges[i].len);
      reqs.push_back(r);
    }
    uint64_t batch = g_api.allocate_batch_id(e->te(), n);
    if (batch == 0) {
      set_error("TransferEngine::allocateBatchID failed");
      return -1;
    }
    Status st = g_api.submit_transfer(e->te(), batch, reqs);
    if (st.code() != 0) {
      set_error(std::string("TransferEngine::submitTransfer: ") +
                st.message() + " (code " + std::to_string(st.code()) + ")");
      Status ignored = g_api.free_batch_id(e->te(), batch);
      (void)ignored;
      return static_cast<int>(st.code());  // Mooncake's Status::Code (> 0)
    }
    *batch_out = batch;
    return 0;
  });
}

// Polls a batch. `*state` gets the Mooncake TransferStatusEnum; `*bytes` the
// bytes transferred so far.
int okv_batch_status(okv_engine* e, uint64_t batch, int32_t* state,
                     uint64_t* bytes) {
  return guarded("okv_batch_status", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_batch_status");
    TransferStatus ts{};
    Status st = g_api.get_batch_transfer_status(e->te(), batch, ts);
    if (st.code() != 0) {
      set_error(std::string("TransferEngine::getBatchTransferStatus: ") +
                st.message() + " (code " + std::to_string(st.code()) + ")");
      return -1;
    }
    *state = static_cast<int32_t>(ts.s);
    *bytes = static_cast<uint64_t>(ts.transferred_bytes);
    return 0;
  });
}

int okv_task_status(okv_engine* e, uint64_t batch, uint64_t task,
                    int32_t* state, uint64_t* bytes) {
  return guarded("okv_task_status", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_task_status");
    TransferStatus ts{};
    Status st = g_api.get_transfer_status(e->te(), batch,
                                          static_cast<size_t>(task), ts);
    if (st.code() != 0) {
      set_error(std::string("TransferEngine::getTransferStatus: ") +
                st.message() + " (code " + std::to_string(st.code()) + ")");
      return -1;
    }
    *state = static_cast<int32_t>(ts.s);
    *bytes = static_cast<uint64_t>(ts.transferred_bytes);
    return 0;
  });
}

int okv_free_batch(okv_engine* e, uint64_t batch) {
  return guarded("okv_free_batch", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_free_batch");
    Status st = g_api.free_batch_id(e->te(), batch);
    if (st.code() != 0) {
      set_error(std::string("TransferEngine::freeBatchID: ") + st.message() +
                " (code " + std::to_string(st.code()) + ")");
      return -1;
    }
    return 0;
  });
}

int okv_send_notify(okv_engine* e, const char* peer, const char* name,
                    size_t name_len, const char* msg, size_t msg_len) {
  return guarded("okv_send_notify", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_send_notify");
    NotifyDesc d{std::string(name, name_len), std::string(msg, msg_len)};
    int r = g_api.send_notify_by_name(e->te(), std::string(peer), d);
    if (r != 0) {
      set_error(std::string("TransferEngine::sendNotifyByName('") + peer +
                "') returned " + std::to_string(r));
      return -1;
    }
    return 0;
  });
}

// Drains the notifications that arrived and calls `cb` once for each.
// Returns the number delivered, or -1.
int okv_take_notifies(okv_engine* e, okv_notify_cb cb, void* ctx) {
  return guarded("okv_take_notifies", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_take_notifies");
    std::vector<NotifyDesc> out;
    int r = g_api.get_notifies(e->te(), out);
    if (r != 0) {
      set_error("TransferEngine::getNotifies returned " + std::to_string(r));
      return -1;
    }
    for (const NotifyDesc& d : out) {
      cb(ctx, d.name.data(), d.name.size(), d.notify_msg.data(),
         d.notify_msg.size());
    }
    return static_cast<int>(out.size());
  });
}

}  // extern "C"

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
};
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
    };
    if (!resolve_all(h, syms, "libcuda.so.1")) return -1;
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

}  // extern "C"

// ---- Mooncake's submit-time wait on the caller's default stream -------------
//
// Mooncake 0.3.13.post1's intra-node NVLink transport starts every
// `submitTransfer` with `cudaEventRecord(ev, cudaStreamPerThread)` followed by
// `cudaEventSynchronize(ev)` (disassembly of engine.so: the only two
// `cudaEventRecord` calls, in `IntraNodeNvlinkTransport::submitTransfer` and
// `submitTransferTask`, both with stream 0x2). The per-thread default stream
// is ordered after the *legacy* default stream, and work on the legacy stream
// waits for every blocking stream (`torch.cuda.Stream()` is one): whatever
// sits on the legacy stream behind a queued forward makes each submit block
// the writer until that forward ran. Measured on an H200: with matmuls queued
// on the default stream a layer's scattered write fell from 20 to 3.3 GB/s.
//
// OrbitKV does not need that wait: a layer is admitted only after a CUDA event
// recorded behind its attention kernel completed (okv_cuda_event_wait above),
// and the copies themselves run on Mooncake's non-blocking stream with
// `cudaMemcpySrcAccessOrderStream`. `okv_redirect_submit_wait` points
// engine.so's imported `cudaEventRecord` (its GOT entries) at
// `okv_event_record`, which records an event Mooncake asks for on
// `cudaStreamPerThread` on an idle non-blocking stream of the calling thread
// instead, so the `cudaEventSynchronize` that follows returns at once. Every
// other `cudaEventRecord` passes through unchanged; Mooncake still issues
// every copy and reports every completion.

namespace {

using CudaEventRecordFn = int (*)(void*, void*);
using CudaStreamCreateFn = int (*)(void**, unsigned int);
using CudaGetDeviceFn = int (*)(int*);

struct Cudart {
  CudaEventRecordFn event_record = nullptr;
  CudaStreamCreateFn stream_create = nullptr;
  CudaGetDeviceFn get_device = nullptr;
};
Cudart g_cudart;
std::mutex g_redirect_mutex;
int g_redirected = -1;  // GOT slots patched, once; -1: not tried yet
std::atomic<uint64_t> g_records_redirected{0};
std::atomic<uint64_t> g_records_passed{0};

constexpr unsigned int kStreamNonBlocking = 1;  // cudaStreamNonBlocking
void* const kStreamPerThread = reinterpret_cast<void*>(0x2);  // cudaStreamPerThread

struct ThreadStream {
  int device = -1;
  void* stream = nullptr;
};
thread_local ThreadStream t_idle_stream;

extern "C" int okv_event_record(void* event, void* stream) {
  if (stream == kStreamPerThread) {
    ThreadStream& ts = t_idle_stream;
    int device = -1;
    if (g_cudart.get_device(&device) != 0) device = -1;
    if (device >= 0 && (ts.stream == nullptr || ts.device != device)) {
      // One stream per thread and device, never destroyed: the writer lanes
      // are few and live as long as the engine. Nothing is ever queued on it.
      void* st = nullptr;
      if (g_cudart.stream_create(&st, kStreamNonBlocking) == 0 && st != nullptr) {
        ts.stream = st;
        ts.device = device;
      }
    }
    if (ts.stream != nullptr && ts.device == device) {
      g_records_redirected.fetch_add(1, std::memory_order_relaxed);
      return g_cudart.event_record(event, ts.stream);
    }
  }
  // Any other stream, or no idle stream could be made: as Mooncake asked.
  g_records_passed.fetch_add(1, std::memory_order_relaxed);
  return g_cudart.event_record(event, stream);
}

// The PT_GNU_RELRO range of the object loaded at `base`, if any.
struct Relro {
  uintptr_t base;
  uintptr_t start = 0;
  uintptr_t end = 0;
};

int find_relro(struct dl_phdr_info* info, size_t, void* data) {
  auto* r = static_cast<Relro*>(data);
  if (info->dlpi_addr != r->base) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type == PT_GNU_RELRO) {
      r->start = info->dlpi_addr + ph.p_vaddr;
      r->end = r->start + ph.p_memsz;
    }
  }
  return 1;
}

// Points every GOT slot of `lm` that binds `name` at `fn`. Returns the count,
// or -1 with the error set.
int patch_got(struct link_map* lm, const char* name, void* fn) {
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  const ElfW(Rela)* jmprel = nullptr;
  size_t jmprel_size = 0;
  const ElfW(Rela)* rela = nullptr;
  size_t rela_size = 0;
  // glibc has already relocated the pointers of the in-memory dynamic
  // section on x86-64; an unrelocated one is below the load base.
  auto ptr = [&](ElfW(Addr) v) -> uintptr_t {
    return v < lm->l_addr ? lm->l_addr + v : v;
  };
  for (const ElfW(Dyn)* d = lm->l_ld; d->d_tag != DT_NULL; ++d) {
    switch (d->d_tag) {
      case DT_SYMTAB: symtab = reinterpret_cast<const ElfW(Sym)*>(ptr(d->d_un.d_ptr)); break;
      case DT_STRTAB: strtab = reinterpret_cast<const char*>(ptr(d->d_un.d_ptr)); break;
      case DT_JMPREL: jmprel = reinterpret_cast<const ElfW(Rela)*>(ptr(d->d_un.d_ptr)); break;
      case DT_PLTRELSZ: jmprel_size = d->d_un.d_val; break;
      case DT_RELA: rela = reinterpret_cast<const ElfW(Rela)*>(ptr(d->d_un.d_ptr)); break;
      case DT_RELASZ: rela_size = d->d_un.d_val; break;
      default: break;
    }
  }
  if (symtab == nullptr || strtab == nullptr) {
    set_error("engine.so has no dynamic symbol table");
    return -1;
  }
  Relro relro{lm->l_addr};
  dl_iterate_phdr(find_relro, &relro);
  const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  int patched = 0;
  auto scan = [&](const ElfW(Rela)* rel, size_t size) -> int {
    for (size_t i = 0; rel != nullptr && i < size / sizeof(ElfW(Rela)); ++i) {
      const auto type = ELF64_R_TYPE(rel[i].r_info);
      if (type != R_X86_64_JUMP_SLOT && type != R_X86_64_GLOB_DAT) continue;
      const ElfW(Sym)& sym = symtab[ELF64_R_SYM(rel[i].r_info)];
      if (std::strcmp(strtab + sym.st_name, name) != 0) continue;
      auto* slot = reinterpret_cast<void**>(lm->l_addr + rel[i].r_offset);
      const uintptr_t at = reinterpret_cast<uintptr_t>(slot);
      const bool ro = at >= relro.start && at < relro.end;
      void* pg = reinterpret_cast<void*>(at & ~(page - 1));
      if (ro && mprotect(pg, page, PROT_READ | PROT_WRITE) != 0) {
        set_error(std::string("mprotect of engine.so's GOT failed: ") + std::strerror(errno));
        return -1;
      }
      __atomic_store_n(slot, fn, __ATOMIC_SEQ_CST);
      if (ro) mprotect(pg, page, PROT_READ);
      ++patched;
    }
    return 0;
  };
  if (scan(jmprel, jmprel_size) != 0 || scan(rela, rela_size) != 0) return -1;
  return patched;
}

}  // namespace

extern "C" {

// Takes Mooncake's submit-time wait on the caller's default stream off the
// writer threads (see above). Idempotent; `*patched` gets the number of GOT
// entries redirected: 0 when engine.so imports no `cudaEventRecord` (the
// wheel without CUDA).
int okv_redirect_submit_wait(int* patched) {
  return guarded("okv_redirect_submit_wait", [&]() -> int {
    if (!g_loaded.load()) return not_loaded("okv_redirect_submit_wait");
    std::lock_guard<std::mutex> lock(g_redirect_mutex);
    if (g_redirected >= 0) {
      *patched = g_redirected;
      return 0;
    }
    // The cudart that engine.so itself binds to (its dependency tree).
    void* record = dlsym(g_engine_handle, "cudaEventRecord");
    if (record == nullptr) {
      g_redirected = 0;
      *patched = 0;
      return 0;
    }
    const NamedSlot syms[] = {
        {"cudaStreamCreateWithFlags", reinterpret_cast<void**>(&g_cudart.stream_create)},
        {"cudaGetDevice", reinterpret_cast<void**>(&g_cudart.get_device)},
    };
    if (!resolve_all(g_engine_handle, syms, "the CUDA runtime engine.so uses")) return -1;
    g_cudart.event_record = reinterpret_cast<CudaEventRecordFn>(record);
    struct link_map* lm = nullptr;
    if (dlinfo(g_engine_handle, RTLD_DI_LINKMAP, &lm) != 0 || lm == nullptr) {
      const char* e = dlerror();
      set_error(std::string("dlinfo(engine.so) failed: ") + (e ? e : "?"));
      return -1;
    }
    int n = patch_got(lm, "cudaEventRecord", reinterpret_cast<void*>(&okv_event_record));
    if (n < 0) return -1;
    g_redirected = n;
    *patched = n;
    return 0;
  });
}

// Events Mooncake recorded through okv_event_record: on the thread's idle
// stream instead of cudaStreamPerThread, and passed through unchanged.
void okv_submit_wait_counts(uint64_t* redirected, uint64_t* passed) {
  *redirected = g_records_redirected.load(std::memory_order_relaxed);
  *passed = g_records_passed.load(std::memory_order_relaxed);
}

}  // extern "C"
