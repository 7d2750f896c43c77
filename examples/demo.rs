//! The main job, on one machine: a prefill engine streams one request's KV
//! cache into a decode engine's KV pages, layer by layer, over Mooncake
//! (TCP on 127.0.0.1), then checks every byte.
//!
//! Run: `./scripts/demo.sh` (or `cargo run --release --example demo --
//! [--layers N] [--blocks N] [--block-kib N] [--tokens N]`).
//!
//! The shape defaults to a Llama-3-8B-like cache: 32 layers, 16-token blocks
//! of 64 KiB per layer (K and V, 8 KV heads x 128 dims x fp16). Each side's
//! cache is one registered tensor per layer, as vLLM allocates it. The
//! request's blocks are scattered on both sides (as a block allocator leaves
//! them); runs that are contiguous on both sides coalesce into one range, and
//! each layer goes as one batch.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use orbitkv::{EngineConfig, MooncakeTransferEngine, WriteRange};

struct Shape {
    layers: usize,
    blocks: usize,
    block_bytes: usize,
    tokens: usize,
    flip_one_byte: bool,
}

const TOKENS_PER_BLOCK: usize = 16;

fn parse_args() -> Result<Shape, String> {
    let mut s = Shape {
        layers: 32,
        blocks: 160,
        block_bytes: 64 << 10,
        tokens: 2000,
        flip_one_byte: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|&v: &usize| v > 0)
                .ok_or_else(|| format!("{name} needs a positive number"))
        };
        match a.as_str() {
            "--layers" => s.layers = num("--layers")?,
            "--blocks" => s.blocks = num("--blocks")?,
            "--block-kib" => s.block_bytes = num("--block-kib")? << 10,
            "--tokens" => s.tokens = num("--tokens")?,
            // Self-check of the verification: corrupt one received byte.
            "--flip-one-byte" => s.flip_one_byte = true,
            "-h" | "--help" => {
                return Err(
                    "usage: demo [--layers N] [--blocks N] [--block-kib N] [--tokens N] [--flip-one-byte]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    if s.tokens.div_ceil(TOKENS_PER_BLOCK) > s.blocks {
        return Err(format!(
            "{} tokens need {} blocks of {TOKENS_PER_BLOCK} tokens; the cache has {}",
            s.tokens,
            s.tokens.div_ceil(TOKENS_PER_BLOCK),
            s.blocks
        ));
    }
    Ok(s)
}

/// A page-aligned per-layer KV tensor that Mooncake reads or writes by address.
struct Tensor {
    buf: Vec<u64>,
}

impl Tensor {
    /// Zeroed and touched (a KV cache is allocated and zeroed up front, so
    /// no first-touch page fault lands inside a timed transfer).
    fn new(bytes: usize) -> Self {
        let mut buf = vec![0u64; bytes.div_ceil(8)];
        for w in buf.iter_mut().step_by(512) {
            // SAFETY: `w` is a valid, aligned element of `buf`; a volatile
            // store is not elided, so every 4 KiB page is really mapped.
            unsafe { std::ptr::write_volatile(w, 0) };
        }
        Tensor { buf }
    }
    fn addr(&self) -> u64 {
        self.buf.as_ptr() as u64
    }
    fn len(&self) -> u64 {
        (self.buf.len() * 8) as u64
    }
    fn flip_byte(&mut self, at: usize) {
        self.buf[at / 8] ^= 0xFF << (8 * (at % 8));
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: a u64 buffer viewed as its bytes (alignment 1 <= 8, same
        // length in bytes); read only while no transfer is in flight.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().cast(), self.buf.len() * 8) }
    }
}

/// Block ids a fragmented allocator hands out: `n` ids in runs of varied
/// length, skipping a few ids between runs. Deterministic.
fn scattered_blocks(n: usize, total: usize, seed: u64) -> Vec<usize> {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let spare = total - n;
    let mut out = Vec::with_capacity(n);
    let mut at = 0;
    let mut skipped = 0;
    while out.len() < n {
        if skipped < spare && next() % 4 == 0 {
            let skip = (1 + next() as usize % 3).min(spare - skipped);
            at += skip;
            skipped += skip;
        }
        let run = (4 + next() as usize % 28).min(n - out.len());
        out.extend(at..at + run);
        at += run;
    }
    out
}

/// Block pairs -> ranges: a run contiguous on both sides becomes one range.
fn coalesce(src: &[usize], dst: &[usize], block: u64) -> Vec<(u64, u64, u64)> {
    let mut out: Vec<(u64, u64, u64)> = Vec::new();
    for (&s, &d) in src.iter().zip(dst) {
        let (s, d) = (s as u64 * block, d as u64 * block);
        match out.last_mut() {
            Some((ps, pd, len)) if *ps + *len == s && *pd + *len == d => *len += block,
            _ => out.push((s, d, block)),
        }
    }
    out
}

fn fill(t: &mut Tensor, layer: usize) {
    // Never zero, so an unwritten decode block (zeros) cannot pass for written.
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (layer as u64 + 1);
    for w in &mut t.buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *w = x | 0x0101_0101_0101_0101;
    }
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::from(2)
        }
    }
}

fn run() -> Result<bool, Box<dyn std::error::Error>> {
    let shape = parse_args()?;
    let layer_bytes = shape.blocks * shape.block_bytes;
    let n_blocks = shape.tokens.div_ceil(TOKENS_PER_BLOCK);
    let src_blocks = scattered_blocks(n_blocks, shape.blocks, 0x5EED_0001);
    let dst_blocks = scattered_blocks(n_blocks, shape.blocks, 0x5EED_0002);
    let ranges = coalesce(&src_blocks, &dst_blocks, shape.block_bytes as u64);

    let t0 = Instant::now();
    let prefill = MooncakeTransferEngine::new(&EngineConfig::default())?;
    let decode = MooncakeTransferEngine::new(&EngineConfig::default())?;
    // Mooncake logs its start-up on stderr; print ours after it.
    println!("OrbitKV demo: one request's KV cache, prefill engine -> decode engine, layer by layer");
    println!(
        "  cache shape : {} layers x {} blocks x {} KiB per side ({:.0} MiB per side, one tensor per layer)",
        shape.layers,
        shape.blocks,
        shape.block_bytes >> 10,
        mib((layer_bytes * shape.layers) as u64)
    );
    println!(
        "  request     : {} tokens -> {} blocks of {TOKENS_PER_BLOCK} tokens per layer, scattered on both sides; \
         coalesced into {} ranges per layer",
        shape.tokens,
        n_blocks,
        ranges.len()
    );

    println!(
        "  engines     : prefill {} -> decode {} (Mooncake {}, TCP loopback), started in {:.0} ms",
        prefill.endpoint(),
        decode.endpoint(),
        prefill.library().version.as_deref().unwrap_or("version unknown"),
        t0.elapsed().as_secs_f64() * 1e3
    );

    let mut src: Vec<Tensor> = (0..shape.layers).map(|_| Tensor::new(layer_bytes)).collect();
    let mut dst: Vec<Tensor> = (0..shape.layers).map(|_| Tensor::new(layer_bytes)).collect();
    for (i, t) in src.iter_mut().enumerate() {
        fill(t, i);
    }
    for t in &src {
        prefill.register_memory(t.addr(), t.len(), "cpu:0")?;
    }
    for t in &dst {
        decode.register_memory(t.addr(), t.len(), "cpu:0")?;
    }

    println!();
    println!("  layer  ranges     bytes      time     GB/s");
    let timeout = Duration::from_secs(60);
    let mut total = 0u64;
    let start = Instant::now();
    for layer in 0..shape.layers {
        let batch: Vec<WriteRange> = ranges
            .iter()
            .map(|&(s, d, len)| WriteRange {
                src: src[layer].addr() + s,
                dst: dst[layer].addr() + d,
                len,
            })
            .collect();
        let t = Instant::now();
        let moved = prefill.write(decode.endpoint(), &batch, timeout)?;
        let secs = t.elapsed().as_secs_f64();
        total += moved;
        println!(
            "  {layer:>5}  {:>6}  {:>6.1} MiB  {:>6.2} ms  {:>6.2}",
            batch.len(),
            mib(moved),
            secs * 1e3,
            moved as f64 / secs / 1e9
        );
    }
    let secs = start.elapsed().as_secs_f64();
    println!(
        "  total  {:>6}  {:>6.1} MiB  {:>6.1} ms  {:>6.2}   ({} batches, one per layer)",
        ranges.len() * shape.layers,
        mib(total),
        secs * 1e3,
        total as f64 / secs / 1e9,
        shape.layers
    );

    if shape.flip_one_byte {
        let (layer, block) = (shape.layers / 2, dst_blocks[n_blocks / 2]);
        let at = block * shape.block_bytes + 12345 % shape.block_bytes;
        dst[layer].flip_byte(at);
        println!("  (--flip-one-byte: flipped byte {at} of decode layer {layer}, block {block})");
    }

    // Verify: every request block equal to its source block, every other
    // decode block still zero.
    let bb = shape.block_bytes;
    let mut bad_blocks = 0usize;
    let mut first_bad = None;
    let mut dirty_free = 0usize;
    for layer in 0..shape.layers {
        let (s, d) = (src[layer].bytes(), dst[layer].bytes());
        for (&sb, &db) in src_blocks.iter().zip(&dst_blocks) {
            if s[sb * bb..(sb + 1) * bb] != d[db * bb..(db + 1) * bb] {
                bad_blocks += 1;
                first_bad.get_or_insert((layer, sb, db));
            }
        }
        for blk in (0..shape.blocks).filter(|b| !dst_blocks.contains(b)) {
            if d[blk * bb..(blk + 1) * bb].iter().any(|&x| x != 0) {
                dirty_free += 1;
            }
        }
    }
    let checked = n_blocks * shape.layers;
    let free = (shape.blocks - n_blocks) * shape.layers;
    println!();
    if bad_blocks == 0 && dirty_free == 0 && total == (checked * bb) as u64 {
        println!(
            "verify: OK: {checked} request blocks byte-equal on the decode side; \
             {free} other decode blocks untouched"
        );
        Ok(true)
    } else {
        println!(
            "verify: FAILED: {bad_blocks} of {checked} request blocks differ (first: {first_bad:?} as \
             (layer, prefill block, decode block)); {dirty_free} of {free} other decode blocks were written; \
             {total} bytes reported moved"
        );
        Ok(false)
    }
}
