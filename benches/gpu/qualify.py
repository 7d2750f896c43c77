#!/usr/bin/env python3
"""OrbitKV GPU qualification: registration, byte correctness with guard bytes,
layer-by-layer KV streaming through `orbitkv.Runtime`, and side-by-side
reference transfers (raw Mooncake, torch copy, NIXL/UCX), producer and
consumer in two processes.

One invocation runs one *configuration* and writes one JSON file:

    qualify.py run --suite mooncake --transport nvlink --src-gpu 0 --dst-gpu 1 --out r.json
    qualify.py run --suite nixl     --src-gpu 0 --dst-gpu 1 --out n.json
    qualify.py run --suite torch    --src-gpu 0 --dst-gpu 1 --out t.json
    qualify.py report --dir DIR --out-json results.json --out-md results.md

`--device cpu` runs the same flow on CPU tensors (Mooncake over TCP, NIXL
over UCX with DRAM) at small sizes, so the whole script can be exercised on a
machine without a GPU:

    qualify.py run --device cpu --suite mooncake --transport tcp --tokens 1024 --layers 4 --out r.json

Suites:
  mooncake  two processes, one `orbitkv.MooncakeTransferEngine` each
            (MC_INTRANODE_NVLINK=1 for --transport nvlink, MC_FORCE_TCP=1 for
            tcp): (a) registration of every buffer, (b) a batch of mixed and
            odd-sized ranges checked byte for byte with guard bytes around
            every destination range, (c) vLLM-shaped KV streamed layer by
            layer through `orbitkv.Runtime` for each prompt size, contiguous
            and scattered block IDs, every written byte compared with the
            producer's source block (the consumer regenerates the producer's
            seeded random KV) after every repetition, and unauthorized blocks
            checked untouched; with `--staging on` (the default) each scattered
            case also through staging (the producer gathers every layer into
            its source staging before `layer_ready`, the runtime writes it
            into the consumer's grant as a few large ranges, the consumer
            scatters the grant into its pages: timed from before the first
            gather to the scatter done, checked like the direct case, and the
            consumer's staging outside the grant checked untouched; the direct
            case then runs against a consumer that grants staging, which a
            producer without source staging ignores), (d) raw `engine.write`
            anchors (1, 16, 256 MiB; 1024 x 64 KiB in one batch and in 8
            batches) and the runtime's own ranges written directly (one batch
            per layer, all submitted at once). With `--head-major --consumer-tp 2`
            every write is a heterogeneous-TP head slice: to decode rank 0
            alone (`--consumer-ranks 0`, the other half never asked for), or
            to both ranks, a consumer process each (`--consumer-ranks both`:
            the whole TP 1 -> 2 request, timed to the later rank's end, every
            rank's bytes, guards and staging checked).
  nixl      two processes, one NIXL agent each (UCX backend): the same anchors
            and the same KV ranges, one transfer per layer, all posted at once.
  torch     one process: `dst.copy_(src)` from the source device to the
            destination device for the same patterns, each checked byte for
            byte after its timing.

Times: CLOCK_MONOTONIC (`time.monotonic_ns`), which is one clock for all
processes of a machine, so the producer's first `layer_ready` and the
consumer's `consumer_completed` event can be compared. GB/s = 10^9 bytes/s.
"""

from __future__ import annotations

import argparse
import sys

from qualifylib.report import cmd_report
from qualifylib.suites import cmd_run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run one configuration")
    r.add_argument("--suite", choices=("mooncake", "nixl", "torch"), default="mooncake")
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--transport", choices=("nvlink", "tcp"), default="nvlink")
    r.add_argument("--src-gpu", type=int, default=0)
    r.add_argument("--dst-gpu", type=int, default=1)
    r.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192, 32768])
    r.add_argument("--layers", type=int, default=32)
    r.add_argument("--raw-mib", type=int, default=256, help="size of the raw buffers (largest one-range write)")
    r.add_argument("--raw-reps", type=int, default=5)
    r.add_argument("--kv-reps", type=int, default=3)
    r.add_argument("--max-in-flight", type=int, default=1 << 30, help="Runtime max_bytes_in_flight_per_peer")
    r.add_argument("--max-ranges-in-flight", type=int, default=768,
                   help="Runtime max_ranges_in_flight_per_peer (orbitkv.pd.max_inflight_ranges; default as there)")
    r.add_argument("--writer-lanes", type=int, default=4,
                   help="Runtime writer_lanes_per_peer (orbitkv.pd.writer_lanes; default as there)")
    r.add_argument("--busy", choices=("none", "default", "side"), default="none",
                   help="keep the producer GPU computing (matmuls) on the legacy default stream or a side stream")
    r.add_argument("--busy-in", choices=("producer", "consumer"), default="producer",
                   help="which process runs --busy's matmuls: the producer (work beside the copies in their own "
                        "CUDA context) or the consumer (another process's context; with --src-gpu = --dst-gpu the "
                        "GPU time-slices between the two processes, as prefill and decode share one GPU in the "
                        "one-GPU end-to-end runs)")
    r.add_argument("--submit-wait", choices=("layer", "device"), default="layer",
                   help="CUDA: Mooncake's submit-time wait on the writer's default stream redirected (the "
                   "PdConnector's default, orbitkv.pd.mooncake_submit_wait) or kept; process-wide, so it applies "
                   "to the raw Mooncake steps too")
    r.add_argument("--step-timeout", type=float, default=60.0)
    r.add_argument("--start-timeout", type=float, default=120.0)
    r.add_argument("--budget-s", type=float, default=120.0, help="skip remaining steps after this")
    r.add_argument("--tcp-queue", type=int, default=65535,
                   help="MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER and MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER for "
                        "--transport tcp (Mooncake's default, 1024, fails scattered KV of >= 8k tokens); "
                        "0 keeps Mooncake's defaults")
    r.add_argument("--staging", choices=("on", "off"), default="on",
                   help="mooncake suite: also stream each scattered KV case through staging (the producer "
                        "gathers each layer into a source staging, the runtime writes it into the consumer's "
                        "grant as a few large ranges, the consumer scatters it), timed end to end")
    r.add_argument("--staging-min-ranges", type=int, default=4,
                   help="Runtime staging_min_ranges with --staging on (grant staging from this many direct "
                        "ranges per layer)")
    r.add_argument("--gather", choices=("event", "sync"), default="event",
                   help="staged steps on CUDA: 'event' queues each layer's gather on the stream and hands the layer "
                        "over with a CUDA event (layers_ready_after: the writer waits, as in the connector); "
                        "'sync': the host waits for each gather before layer_ready (the figures before 2026-12-01 14:00)")
    r.add_argument("--head-major", action="store_true",
                   help="KV blocks head-major on both sides (vLLM's HND layout: [8 heads, 16 tokens, 128])")
    r.add_argument("--consumer-tp", type=int, choices=(1, 2), default=1,
                   help="2: the consumer is TP rank 0 of 2 (heads 0-3; needs --head-major): every write is a "
                        "heterogeneous-TP head slice (16 KiB of each 32 KiB block); raw-write steps are skipped")
    r.add_argument("--consumer-ranks", choices=("0", "both"), default="0",
                   help="with --consumer-tp 2: '0' only decode rank 0 takes part (the other rank's half is never "
                        "asked for); 'both': ranks 0 and 1, one process each, in every request (the whole TP 1 -> 2 "
                        "request: timed to the later rank's completion, both checked)")
    r.add_argument("--notify-poll-ms", type=float, default=None,
                   help="Runtime notify_poll_ms on both sides (how often decode drains Mooncake's notifications "
                        "while it waits; default: the runtime's, 0.25)")
    r.add_argument("--trace", action="store_true",
                   help="mooncake suite: each process writes its OrbitKV actor trace (Chrome format, "
                        "docs/tracing.md) to $OUT/traces/ (a timeline of where a layer's time goes; it costs "
                        "some host time, so its figures are not the qualification's)")
    r.add_argument("--corrupt", action="store_true",
                   help="self-test of the checks: damage one written byte and one guard byte before every "
                        "check of the mooncake suite; every check must then report it")
    r.add_argument("--out", required=True)
    p = sub.add_parser("report", help="merge configuration JSONs into results.json and a markdown table")
    p.add_argument("--dir", required=True)
    p.add_argument("--meta", help="JSON object of machine facts to print on top")
    p.add_argument("--out-json", required=True)
    p.add_argument("--out-md", required=True)
    args = ap.parse_args()
    if args.cmd == "run":
        if args.device == "cpu":
            args.src_gpu = args.dst_gpu = None
        if args.consumer_tp > 1 and not (args.head_major and args.suite == "mooncake"):
            ap.error("--consumer-tp 2 needs --head-major and --suite mooncake (a token-major head slice "
                     "is not one range per block, and only the runtime writes slices)")
        if args.consumer_ranks == "both" and args.consumer_tp < 2:
            ap.error("--consumer-ranks both needs --consumer-tp 2")
        return cmd_run(args)
    return cmd_report(args)


if __name__ == "__main__":
    sys.exit(main())
