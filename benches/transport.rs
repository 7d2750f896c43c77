//! Loopback throughput: this binding against Mooncake's own Python binding
//! and against `memcpy`: same bytes, same batch shapes, one run.
//!
//! Run: `./scripts/bench.sh` (= `source scripts/env.sh && cargo bench --bench
//! transport -- [--rounds R] [--iters K] [--spin]`).
//!
//! Set-up (three processes, TCP on 127.0.0.1):
//! * a receiver process (this binary re-invoked) that registers a 64 MiB
//!   destination and does nothing else: Mooncake's own TCP server threads
//!   receive the bytes. Both senders write into it, never at the same time;
//! * sender (a): this process, `MooncakeTransferEngine::write` (submit, then
//!   the library's `wait`);
//! * sender (b): `benches/mooncake_py_bench.py`, Mooncake's Python binding
//!   `TransferEngine.batch_transfer_sync_write`, driven over a pipe;
//! * (c) `memcpy` of the same ranges between two buffers of this process.
//!
//! Rounds interleave (a), (b), (c) per shape (alternating which sender goes
//! first), so background load on a shared machine hits all of them alike.
//! Throughput = bytes / median seconds per batch; p10/p90 in brackets.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::{Duration, Instant};

use orbitkv::{BatchState, EngineConfig, MooncakeTransferEngine, WriteRange};

const MIB: u64 = 1 << 20;
const TOTAL: u64 = 64 * MIB;
/// (ranges per batch, bytes per range). The destination holds 64 MiB.
const SHAPES: [(u64, u64); 5] = [
    (1, 64 * MIB),
    (16, 4 * MIB),
    (1024, 64 << 10),
    (256, 64 << 10),
    (1024, 4 << 10),
];
const ROLE_ENV: &str = "ORBITKV_BENCH_ROLE";
const OURS_FILL: u8 = 0xAB;
const PY_FILL: u8 = 0x01; // numpy.ones in the Python sender

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() {
    if std::env::var(ROLE_ENV).as_deref() == Ok("receiver") {
        if let Err(e) = receiver() {
            println!("ERR {e}");
            std::process::exit(2);
        }
        return;
    }
    if let Err(e) = driver() {
        eprintln!("transport bench failed: {e}");
        std::process::exit(1);
    }
}

// ------------------------------------------------------------- receiver

fn receiver() -> Res<()> {
    let engine = MooncakeTransferEngine::new(&EngineConfig::default())?;
    let mut dst = vec![0u8; TOTAL as usize];
    dst.fill(0x5A); // touch every page before timing starts
    let addr = dst.as_mut_ptr() as u64;
    engine.register_memory(addr, TOTAL, "cpu:0")?;
    println!("READY {} {addr}", engine.endpoint());
    std::io::stdout().flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let w: Vec<&str> = line.split_whitespace().collect();
        match w.as_slice() {
            ["COUNT", v] => {
                let v: u8 = v.parse()?;
                // SAFETY: no sender writes while the driver waits for this
                // answer; `addr` is `dst`'s buffer of TOTAL bytes.
                let bytes = unsafe { std::slice::from_raw_parts(addr as *const u8, TOTAL as usize) };
                println!("COUNT {}", bytes.iter().filter(|&&b| b == v).count());
            }
            ["EXIT"] => break,
            _ => println!("ERR unknown command {line:?}"),
        }
        std::io::stdout().flush()?;
    }
    drop(engine);
    drop(dst);
    Ok(())
}

// ---------------------------------------------------------- child plumbing

struct Proc {
    name: &'static str,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Proc {
    fn spawn(name: &'static str, mut cmd: Command) -> Res<Proc> {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        let stdin = child.stdin.take().ok_or("stdin")?;
        let out = child.stdout.take().ok_or("stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        Ok(Proc {
            name,
            child,
            stdin,
            lines,
        })
    }

    /// Next line starting with `want`, or an error (an `ERR` line, exit, timeout).
    fn expect(&mut self, want: &str, timeout: Duration) -> Res<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let l = self
                .lines
                .recv_timeout(left)
                .map_err(|e| format!("{}: no {want} line ({e})", self.name))?;
            if let Some(rest) = l.strip_prefix(want) {
                return Ok(rest.trim().to_string());
            }
            if l.starts_with("ERR") {
                return Err(format!("{}: {l}", self.name).into());
            }
        }
    }

    fn send(&mut self, line: &str) -> Res<()> {
        writeln!(self.stdin, "{line}")?;
        self.stdin.flush()?;
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "EXIT");
        let _ = self.stdin.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn python() -> String {
    if let Ok(p) = std::env::var("ORBITKV_PYTHON") {
        return p;
    }
    if let Ok(v) = std::env::var("VIRTUAL_ENV") {
        let p = format!("{v}/bin/python");
        if std::path::Path::new(&p).exists() {
            return p;
        }
    }
    let venv = concat!(env!("CARGO_MANIFEST_DIR"), "/.venv/bin/python");
    if std::path::Path::new(venv).exists() {
        return venv.into();
    }
    "python3".into()
}

// ------------------------------------------------------------------ driver

struct Opts {
    rounds: usize,
    iters: usize,
    spin: bool,
    smoke: bool,
}

/// `cargo bench` passes `--bench`: a full run. Without it (`cargo test
/// --all-targets` runs bench targets too) this is a smoke run: one sample
/// per cell, same code path, so the test suite checks the benchmark works.
fn opts() -> Res<Opts> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut o = Opts {
        rounds: 12,
        iters: 4,
        spin: false,
        smoke: !args.iter().any(|a| a == "--bench"),
    };
    if o.smoke {
        o.rounds = 1;
        o.iters = 1;
        println!("transport bench: smoke run (no --bench); `./scripts/bench.sh` measures");
        return Ok(o);
    }
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        match a.as_str() {
            "--rounds" => o.rounds = args.next().ok_or("--rounds N")?.parse()?,
            "--iters" => o.iters = args.next().ok_or("--iters N")?.parse()?,
            "--spin" => o.spin = true,
            "--bench" => {}
            other => return Err(format!("unknown argument {other:?}").into()),
        }
    }
    if o.rounds == 0 || o.iters == 0 {
        return Err("--rounds and --iters must be positive".into());
    }
    Ok(o)
}

fn ranges(count: u64, size: u64, src: u64, dst: u64) -> Vec<WriteRange> {
    (0..count)
        .map(|i| WriteRange {
            src: src + i * size,
            dst: dst + i * size,
            len: size,
        })
        .collect()
}

/// Submit, then poll without sleeping (the strategy of Mooncake's own
/// `batch_transfer_sync_write`), to compare with the library's `wait`.
fn write_spin(e: &MooncakeTransferEngine, peer: &str, r: &[WriteRange]) -> Res<()> {
    let mut h = e.submit_write(peer, r)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match e.poll(&mut h)? {
            BatchState::Completed { .. } => return Ok(()),
            BatchState::Failed { reason } => return Err(reason.into()),
            BatchState::InFlight if Instant::now() > deadline => return Err("timeout".into()),
            BatchState::InFlight => std::hint::spin_loop(),
        }
    }
}

#[derive(Default)]
struct Samples {
    secs: Vec<f64>,
}

impl Samples {
    fn q(&self, p: f64) -> f64 {
        let mut v = self.secs.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((v.len() - 1) as f64 * p).round() as usize;
        v[i]
    }
    /// GB/s at the median, and at p10/p90 of the time (slow, fast).
    fn gbps(&self, bytes: u64) -> (f64, f64, f64) {
        let g = |s: f64| bytes as f64 / s / 1e9;
        (g(self.q(0.5)), g(self.q(0.9)), g(self.q(0.1)))
    }
}

fn driver() -> Res<()> {
    let o = opts()?;
    let timeout = Duration::from_secs(60);

    let mut rx_cmd = Command::new(std::env::current_exe()?);
    rx_cmd.env(ROLE_ENV, "receiver");
    let mut rx = Proc::spawn("receiver", rx_cmd)?;
    let ready = rx.expect("READY", Duration::from_secs(60))?;
    let mut it = ready.split_whitespace();
    let rx_ep = it.next().ok_or("receiver endpoint")?.to_string();
    let rx_base: u64 = it.next().ok_or("receiver address")?.parse()?;

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/mooncake_py_bench.py");
    let mut py_cmd = Command::new(python());
    py_cmd.arg(script).arg(TOTAL.to_string());
    let mut py = Proc::spawn("mooncake python sender", py_cmd)?;
    py.expect("READY", Duration::from_secs(60))?;

    let engine = MooncakeTransferEngine::new(&EngineConfig::default())?;
    let src = vec![OURS_FILL; TOTAL as usize];
    let src_addr = src.as_ptr() as u64;
    engine.register_memory(src_addr, TOTAL, "cpu:0")?;
    let mut copy_dst = vec![0x5Au8; TOTAL as usize];

    // Sanity: both senders really move all the bytes into the receiver.
    let whole = ranges(1, TOTAL, src_addr, rx_base);
    engine.write(&rx_ep, &whole, timeout)?;
    rx.send(&format!("COUNT {OURS_FILL}"))?;
    let n: u64 = rx.expect("COUNT", timeout)?.parse()?;
    if n != TOTAL {
        return Err(format!("after our write the receiver holds {n} of {TOTAL} expected bytes").into());
    }
    py.send(&format!("RUN {rx_ep} {rx_base} 1 {TOTAL} 1"))?;
    py.expect("RESULT", timeout)?;
    rx.send(&format!("COUNT {PY_FILL}"))?;
    let n: u64 = rx.expect("COUNT", timeout)?.parse()?;
    if n != TOTAL {
        return Err(
            format!("after the Python write the receiver holds {n} of {TOTAL} expected bytes").into(),
        );
    }

    let n_shapes = SHAPES.len();
    let mut ours: Vec<Samples> = (0..n_shapes).map(|_| Samples::default()).collect();
    let mut spin: Vec<Samples> = (0..n_shapes).map(|_| Samples::default()).collect();
    let mut pys: Vec<Samples> = (0..n_shapes).map(|_| Samples::default()).collect();
    let mut cpy: Vec<Samples> = (0..n_shapes).map(|_| Samples::default()).collect();

    let started = Instant::now();
    // Round 0 is warm-up (connections, caches) and is not recorded.
    for round in 0..=o.rounds {
        let keep = round > 0;
        for (si, &(count, size)) in SHAPES.iter().enumerate() {
            let r = ranges(count, size, src_addr, rx_base);
            let run_ours = |out: &mut Samples| -> Res<()> {
                for _ in 0..o.iters {
                    let t = Instant::now();
                    engine.write(&rx_ep, &r, timeout)?;
                    out.secs.push(t.elapsed().as_secs_f64());
                }
                Ok(())
            };
            let run_spin = |out: &mut Samples| -> Res<()> {
                for _ in 0..o.iters {
                    let t = Instant::now();
                    write_spin(&engine, &rx_ep, &r)?;
                    out.secs.push(t.elapsed().as_secs_f64());
                }
                Ok(())
            };
            let mut run_py = |out: &mut Samples| -> Res<()> {
                py.send(&format!("RUN {rx_ep} {rx_base} {count} {size} {}", o.iters))?;
                let res = py.expect("RESULT", timeout)?;
                for s in res.split_whitespace() {
                    out.secs.push(s.parse()?);
                }
                Ok(())
            };
            let mut scratch = Samples::default();
            if round % 2 == 0 {
                run_ours(if keep { &mut ours[si] } else { &mut scratch })?;
                run_py(if keep { &mut pys[si] } else { &mut scratch })?;
            } else {
                run_py(&mut pys[si])?;
                run_ours(&mut ours[si])?;
            }
            if o.spin {
                run_spin(if keep { &mut spin[si] } else { &mut scratch })?;
            }
            for _ in 0..o.iters {
                let t = Instant::now();
                for i in 0..count {
                    let (a, b) = ((i * size) as usize, ((i + 1) * size) as usize);
                    copy_dst[a..b].copy_from_slice(&src[a..b]);
                }
                std::hint::black_box(&copy_dst);
                let dt = t.elapsed().as_secs_f64();
                if keep {
                    cpy[si].secs.push(dt);
                }
            }
        }
    }
    let elapsed = started.elapsed();
    engine.unregister_memory(src_addr)?;

    // ---- the table
    let per = o.rounds * o.iters;
    println!();
    println!(
        "Loopback TCP, two processes per sender (sender -> receiver), {} samples per cell \
         ({} rounds x {} batches, interleaved), {:.0} s",
        per,
        o.rounds,
        o.iters,
        elapsed.as_secs_f64()
    );
    println!(
        "GB/s = batch bytes / median batch time (10^9 bytes/s), [p10 .. p90]; ms = median batch time.\n"
    );
    let mut head = String::from(
        "| batch shape | bytes | ours: `MooncakeTransferEngine::write` | Mooncake Python \
         `batch_transfer_sync_write` | memcpy |",
    );
    let mut rule = String::from("| --- | --- | --- | --- | --- |");
    if o.spin {
        head.push_str(" ours, busy-poll |");
        rule.push_str(" --- |");
    }
    head.push_str(" ours / Mooncake-Py | ours / memcpy |");
    rule.push_str(" --- | --- |");
    println!("{head}\n{rule}");
    let cell = |s: &Samples, bytes: u64| {
        let (m, lo, hi) = s.gbps(bytes);
        format!("{m:.2} GB/s [{lo:.2} .. {hi:.2}], {:.2} ms", s.q(0.5) * 1e3)
    };
    let mut ratios = Vec::new();
    for (si, &(count, size)) in SHAPES.iter().enumerate() {
        let label = if size >= MIB {
            format!("{count} x {} MiB", size / MIB)
        } else {
            format!("{count} x {} KiB", size >> 10)
        };
        let bytes = count * size;
        let (o_m, _, _) = ours[si].gbps(bytes);
        let (p_m, _, _) = pys[si].gbps(bytes);
        let (c_m, _, _) = cpy[si].gbps(bytes);
        ratios.push(o_m / p_m);
        let mut row = format!(
            "| {label} | {} MiB | {} | {} | {} |",
            bytes / MIB,
            cell(&ours[si], bytes),
            cell(&pys[si], bytes),
            cell(&cpy[si], bytes)
        );
        if o.spin {
            row.push_str(&format!(" {} |", cell(&spin[si], bytes)));
        }
        row.push_str(&format!(" {:.3} | {:.3} |", o_m / p_m, o_m / c_m));
        println!("{row}");
    }
    let geo = ratios.iter().map(|r| r.ln()).sum::<f64>() / ratios.len() as f64;
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    println!(
        "\nours / Mooncake-Py: geometric mean {:.3}, lowest {:.3} (goal: >= 0.95)",
        geo.exp(),
        min
    );
    drop(py);
    drop(rx);
    Ok(())
}
