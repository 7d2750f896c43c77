//! Runs every scripted failure scenario in `examples/` (real Mooncake on
//! 127.0.0.1) and asserts it exits 0 with its `VERDICT <name>: contract held`
//! line.
//!
//! The examples are built first with `cargo build --example …` (the cargo that
//! runs this test, same target directory and profile): `cargo test
//! --all-targets` compiles examples as test harnesses, not as the programs
//! `cargo run --example` runs, so the programs may be missing or stale. The
//! build is a no-op when they are up to date. Then each program is run from
//! `target/<profile>/examples/<name>`, found next to this test's executable.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// `target/<profile>`, from this test's path (`target/<profile>/deps/examples_run-…`).
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps")
        .to_path_buf()
}

const SCENARIOS: [&str; 5] = [
    "scenario_id_reuse",
    "scenario_producer_error",
    "scenario_abort_mid_layer",
    "scenario_stale_notice",
    "scenario_missing_producer",
];

/// Builds the scenario programs once per test process.
fn built() -> &'static Result<(), String> {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(&cargo);
        cmd.args(["build", "--quiet"])
            .current_dir(env!("CARGO_MANIFEST_DIR"));
        for name in SCENARIOS {
            cmd.args(["--example", name]);
        }
        if profile_dir().file_name().is_some_and(|p| p == "release") {
            cmd.arg("--release");
        }
        let out = cmd.output().map_err(|e| format!("cannot run {cargo}: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "`cargo build --example …` failed ({}):\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    })
}

/// Runs example `name` (killed after `limit`), returns (success, stdout).
fn run_example(name: &str, limit: Duration) -> (bool, String) {
    if let Err(e) = built() {
        panic!("{e}");
    }
    let bin = profile_dir().join("examples").join(name);
    assert!(bin.is_file(), "{} is missing after the build", bin.display());
    let mut child = Command::new(&bin)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    // Read both pipes on threads, so a full pipe never stalls the child.
    let mut so = child.stdout.take().expect("piped");
    let mut se = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut so, &mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut se, &mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the example") {
            break Some(st);
        }
        if started.elapsed() > limit {
            let _ = child.kill(); // this test's own child, by handle
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    println!("---- {name} stdout ----\n{stdout}");
    match status {
        Some(st) if st.success() => (true, stdout),
        Some(st) => {
            println!("---- {name} stderr (tail) ----\n{}", tail(&stderr, 40));
            println!("{name} exited with {st}");
            (false, stdout)
        }
        None => {
            println!("---- {name} stderr (tail) ----\n{}", tail(&stderr, 40));
            println!("{name} was killed after {limit:?}");
            (false, stdout)
        }
    }
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn scenario(name: &str) {
    let (ok, stdout) = run_example(name, Duration::from_secs(120));
    let verdict = format!("VERDICT {name}: contract held");
    assert!(
        stdout.lines().any(|l| l.starts_with(&verdict)),
        "{name}: no `{verdict}` line (see its output above)"
    );
    assert!(
        !stdout.contains("BROKEN"),
        "{name}: a check broke (see its output above)"
    );
    assert!(ok, "{name} did not exit 0 (see its output above)");
}

#[test]
fn scenario_id_reuse() {
    scenario("scenario_id_reuse");
}

#[test]
fn scenario_producer_error() {
    scenario("scenario_producer_error");
}

#[test]
fn scenario_abort_mid_layer() {
    scenario("scenario_abort_mid_layer");
}

#[test]
fn scenario_stale_notice() {
    scenario("scenario_stale_notice");
}

#[test]
fn scenario_missing_producer() {
    scenario("scenario_missing_producer");
}
