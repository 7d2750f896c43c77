// OrbitKV's C shim over the C++ API that Mooncake's `engine.so` exports (the
// shim's first part; cuda.cc and submit_wait.cc are the others, common.h what
// they share).
//
// Mooncake ships no C API and no headers on any package registry; its wheels
// ship `mooncake/engine.so`, which exports the non-virtual members of
// `mooncake::TransferEngine` (C++11 string ABI). This file declares the few
// data types those members take *by value* exactly as Mooncake 0.3.13.post1
// lays them out, resolves the members with dlsym at run time, and offers them
// to Rust as plain C functions.
//
// Every entry point keeps the rules written in common.h (no C++ exception
// crosses into Rust, non-zero means failure, pointers only read during the
// call).

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

#include "common.h"

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
std::mutex g_load_mutex;

struct Symbol {
  const char* mangled;
  const char* readable;
  void** slot;
};

}  // namespace

namespace okv {

void* g_engine_handle = nullptr;
std::atomic<bool> g_loaded{false};

namespace {
thread_local std::string t_last_error;
}  // namespace

void set_error(std::string msg) { t_last_error = std::move(msg); }

const char* last_error() { return t_last_error.c_str(); }

int not_loaded(const char* what) {
  set_error(std::string(what) + ": Mooncake library not loaded (call okv_load first)");
  return -1;
}

}  // namespace okv

using namespace okv;  // the shared helpers of common.h (and the loaded engine.so)

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

const char* okv_last_error(void) { return okv::last_error(); }

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

