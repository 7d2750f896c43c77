//! Compiles the C shim over Mooncake's exported C++ API (`src/transport/shim/`:
//! `mooncake.cc`, the CUDA driver calls in `cuda.cc`, the submit-wait redirect
//! in `submit_wait.cc`, what they share in `common.h`).
//! Mooncake itself is not linked here: the shim loads it at run time.

fn main() {
    println!("cargo:rerun-if-changed=src/transport/shim");
    if std::env::var_os("CARGO_FEATURE_RUNTIME").is_none() {
        return; // the protocol core alone (no transport): nothing to compile
    }
    cc::Build::new()
        .cpp(true)
        .files([
            "src/transport/shim/mooncake.cc",
            "src/transport/shim/cuda.cc",
            "src/transport/shim/submit_wait.cc",
        ])
        .flag_if_supported("-std=c++17")
        // Mooncake's wheels use the C++11 string ABI; so must we.
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .warnings_into_errors(true)
        .compile("orbitkv_mooncake_shim");
    println!("cargo:rustc-link-lib=dylib=dl");
    println!("cargo:rustc-link-lib=dylib=stdc++");
}
