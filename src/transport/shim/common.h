// What the shim's three parts share (mooncake.cc, cuda.cc, submit_wait.cc):
// the thread-local error every entry point reports through, the guard that
// keeps C++ exceptions out of Rust, symbol resolution, and the state of the
// loaded engine.so.
//
// Rules kept by every entry point of the shim:
//   * no C++ exception crosses into Rust: each body runs inside `guarded`,
//     which catches everything and stores the message in a thread-local;
//   * a non-zero return means failure and `okv_last_error()` says why;
//   * pointers handed in are only read for the duration of the call.
#pragma once

#include <dlfcn.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <string>

namespace okv {

// The calling thread's last error (what `okv_last_error` returns).
void set_error(std::string msg);

// engine.so, kept open for the process once `okv_load` succeeded.
extern void* g_engine_handle;
extern std::atomic<bool> g_loaded;

// Sets "Mooncake library not loaded" for `what`; returns -1.
int not_loaded(const char* what);

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

}  // namespace okv
