// The shim's third part (see mooncake.cc for the first, common.h for what
// they share): takes Mooncake's submit-time wait on the caller's default
// stream off the writer threads.

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>

#include "common.h"

using namespace okv;  // the shared helpers of common.h (and the loaded engine.so)

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
// recorded behind its attention kernel completed (okv_cuda_event_wait, cuda.cc),
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
