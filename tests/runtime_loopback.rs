//! The request runtime against the real Mooncake engine on 127.0.0.1:
//! producers stream layers into a consumer's authorized blocks, bytes are
//! checked, nothing outside the authorization is touched, notices are routed.

use std::time::{Duration, Instant};

use orbitkv::{
    EngineConfig, Generation, MooncakeTransferEngine, Notice, Outcome, ProducerRank, RequestId, Runtime,
    RuntimeError, RuntimeEvent,
};

const GUARD: u8 = 0xA5;

use orbitkv::testing::{
    block, capability as cap, host_rank as rank, wait_for, wait_released, HostRank as Rank,
};

/// The consumer's verdict on a request: completed or failed.
fn outcome(rt: &Runtime) -> RuntimeEvent {
    wait_for(rt, "the consumer's outcome", |e| {
        matches!(
            e,
            RuntimeEvent::ConsumerCompleted { .. } | RuntimeEvent::ConsumerFailed { .. }
        )
    })
}

/// Asserts that no byte of `layer`'s block `b` on `r` was written.
fn assert_untouched(r: &Rank, layer: u32, b: u32) {
    assert!(
        block(r, layer, b).iter().all(|&x| x == GUARD),
        "layer {layer}: unauthorized block {b} touched"
    );
}

fn src_pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) % 251) as u8
}

/// Streams request `req` whole: both sides open (`src` → `dst`), the
/// handshake, every layer of every block, the finish; returns the
/// consumer's verdict.
fn stream_whole(
    producer: &Rank,
    consumer: &Rank,
    req: &RequestId,
    src: &[u32],
    dst: &[u32],
    layers: u32,
) -> RuntimeEvent {
    let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, req, src, dst);
    producer.runtime.producer_handshake(hs).unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(req, l, 0..dst.len() as u32).unwrap();
    }
    producer.runtime.producer_finish(req).unwrap();
    outcome(&consumer.runtime)
}

/// Asserts that every consumer block of `pairs` (source block, destination
/// block) holds its source's bytes in every layer and that no other block
/// of the consumer's `blocks` was touched.
fn assert_only_pairs_written(
    producer: &Rank,
    consumer: &Rank,
    layers: u32,
    blocks: u32,
    pairs: &[(u32, u32)],
) {
    for l in 0..layers {
        for b in 0..blocks {
            match pairs.iter().find(|(_, d)| *d == b) {
                Some((s, _)) => assert_eq!(
                    block(consumer, l, b),
                    block(producer, l, *s),
                    "layer {l} block {b}"
                ),
                None => assert_untouched(consumer, l, b),
            }
        }
    }
}

#[test]
fn one_producer_streams_layers_into_authorized_blocks_only() {
    let (layers, blocks, bb) = (4, 16, 4096);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-one");
    let src_blocks = vec![0, 1, 2, 3, 7];
    let dst_blocks = vec![5, 6, 7, 12, 2];

    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst_blocks.clone(), 1)
        .unwrap();
    producer
        .runtime
        .producer_open(req.clone(), src_blocks.clone(), cap(), 1)
        .unwrap();
    // Two layers are ready before the handshake, two after: both orders work.
    producer.runtime.layer_ready(&req, 0, 0..5).unwrap();
    producer.runtime.layer_ready(&req, 1, 0..3).unwrap();
    producer.runtime.producer_handshake_json(&hs.to_json()).unwrap();
    producer.runtime.layer_ready(&req, 1, 3..5).unwrap();
    producer.runtime.layer_ready(&req, 2, 0..5).unwrap();
    producer.runtime.layer_ready(&req, 3, 0..5).unwrap();
    producer.runtime.producer_finish(&req).unwrap();

    let (done, why) = wait_released(&producer.runtime, &req);
    assert_eq!(done, Outcome::Done, "{why:?}");
    let ev = outcome(&consumer.runtime);
    let expected_bytes = layers as u64 * 5 * bb;
    assert_eq!(
        ev,
        RuntimeEvent::ConsumerCompleted {
            request: req.clone(),
            generation: hs.generation,
            bytes: expected_bytes,
            staged: None,
        }
    );

    for l in 0..layers {
        for b in 0..blocks {
            match dst_blocks.iter().position(|&d| d == b) {
                Some(i) => assert_eq!(
                    block(&consumer, l, b),
                    block(&producer, l, src_blocks[i]),
                    "layer {l} block {b}"
                ),
                None => assert_untouched(&consumer, l, b),
            }
        }
    }

    consumer.runtime.consumer_release(&req).unwrap();
    wait_for(&consumer.runtime, "consumer release", |e| {
        matches!(e, RuntimeEvent::ConsumerReleased { .. })
    });
    assert_eq!(consumer.runtime.live_requests(), (0, 0));
    assert_eq!(producer.runtime.live_requests(), (0, 0));
    let s = producer.runtime.stats();
    assert_eq!(s.bytes_written, expected_bytes);
    assert_eq!(s.writes_failed, 0);
    assert_eq!(consumer.runtime.stats().notices_routed, 1);
}

#[test]
fn two_producer_ranks_fill_their_head_halves_and_the_consumer_waits_for_both() {
    // The model has 4 KV heads of 1 KiB per block; the consumer (TP 1) holds
    // all 4, each producer (TP 2) holds 2.
    let (layers, blocks, hb) = (3, 8, 1024u64);
    let consumer = rank(layers, blocks, 4 * hb, (0, 1), 4, |_| GUARD);
    let p0 = rank(layers, blocks, 2 * hb, (0, 2), 4, src_pattern);
    let p1 = rank(layers, blocks, 2 * hb, (1, 2), 4, |i| src_pattern(i + 7));
    let req = RequestId::new("req-tp2");
    let src_blocks = vec![1, 2, 3];
    let dst_blocks = vec![4, 5, 0];
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst_blocks.clone(), 2)
        .unwrap();
    assert_eq!(hs.expected_producers, 2);

    for p in [&p0, &p1] {
        p.runtime.producer_handshake(hs.clone()).unwrap(); // before open: parked
        p.runtime
            .producer_open(req.clone(), src_blocks.clone(), cap(), 1)
            .unwrap();
    }
    for l in 0..layers {
        p0.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    p0.runtime.producer_finish(&req).unwrap();
    wait_for(&p0.runtime, "p0 release", |e| {
        matches!(
            e,
            RuntimeEvent::ProducerReleased {
                outcome: Outcome::Done,
                ..
            }
        )
    });
    // One producer done is not enough.
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !consumer
            .runtime
            .poll_events()
            .iter()
            .any(|e| matches!(e, RuntimeEvent::ConsumerCompleted { .. })),
        "completed with one of two producers"
    );
    for l in 0..layers {
        p1.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    p1.runtime.producer_finish(&req).unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(matches!(ev, RuntimeEvent::ConsumerCompleted { .. }), "{ev:?}");

    for l in 0..layers {
        for b in 0..blocks {
            let got = block(&consumer, l, b);
            match dst_blocks.iter().position(|&d| d == b) {
                Some(i) => {
                    let s = src_blocks[i];
                    assert_eq!(
                        &got[..2 * hb as usize],
                        block(&p0, l, s),
                        "layer {l} block {b} heads 0-1"
                    );
                    assert_eq!(
                        &got[2 * hb as usize..],
                        block(&p1, l, s),
                        "layer {l} block {b} heads 2-3"
                    );
                }
                None => assert_untouched(&consumer, l, b),
            }
        }
    }
}

#[test]
fn notices_for_unknown_requests_or_stale_generations_are_dropped_and_counted() {
    let consumer = rank(1, 4, 4096, (0, 1), 2, |_| GUARD);
    let sender = MooncakeTransferEngine::new(&EngineConfig::default()).unwrap();
    let req = RequestId::new("req-stale");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1], 1)
        .unwrap();
    let notice = |request: &str, generation: Generation| Notice {
        version: orbitkv::wire::WIRE_VERSION,
        request_id: RequestId::new(request),
        generation,
        producer_rank: ProducerRank(0),
        outcome: Outcome::Done,
        reason: None,
        bytes: 0,
        staged: false,
        mac: None,
    };
    let ep = consumer.runtime.endpoint().to_string();
    sender
        .send_notification(&ep, "orbitkv", &notice("nobody", hs.generation).to_json())
        .unwrap();
    sender
        .send_notification(
            &ep,
            "orbitkv",
            &notice("req-stale", Generation(hs.generation.0 - 1)).to_json(),
        )
        .unwrap();
    sender
        .send_notification(&ep, "orbitkv", b"{\"version\": 1}")
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let s = consumer.runtime.stats();
        if s.notices_unknown_request == 1 && s.notices_stale_generation == 1 && s.notices_malformed == 1 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let s = consumer.runtime.stats();
    assert_eq!(
        (
            s.notices_unknown_request,
            s.notices_stale_generation,
            s.notices_malformed
        ),
        (1, 1, 1)
    );
    assert_eq!(s.notices_routed, 0);
    assert!(
        consumer.runtime.poll_events().is_empty(),
        "a dropped notice reached the request"
    );
}

#[test]
fn bad_input_gets_typed_errors_and_changes_nothing() {
    let p = rank(2, 4, 4096, (0, 1), 2, src_pattern);
    let c = rank(2, 4, 4096, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-bad");
    assert!(matches!(
        p.runtime.layer_ready(&req, 0, 0..1),
        Err(RuntimeError::UnknownRequest(_))
    ));
    assert!(matches!(
        p.runtime.producer_finish(&req),
        Err(RuntimeError::UnknownRequest(_))
    ));
    assert!(matches!(
        c.runtime.consumer_release(&req),
        Err(RuntimeError::UnknownRequest(_))
    ));
    assert!(matches!(
        c.runtime.consumer_open(req.clone(), cap(), 0, vec![9], 1),
        Err(RuntimeError::Geometry(_))
    ));
    assert!(matches!(
        p.runtime.producer_handshake_json("{\"version\": 3}"),
        Err(RuntimeError::Protocol(_))
    ));
    let mut hs = c
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1, 2], 1)
        .unwrap();
    assert!(matches!(
        c.runtime.consumer_open(req.clone(), cap(), 0, vec![3], 1),
        Err(RuntimeError::DuplicateRequest(_))
    ));
    // Wrong geometry: the consumer claims blocks of another size.
    hs.layout.layers[0].planes[0].block_bytes = 2048;
    hs.layout.layers[0].planes[0].block_stride = 2048;
    assert!(matches!(
        p.runtime.producer_handshake(hs),
        Err(RuntimeError::Geometry(_))
    ));
    p.runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    assert!(matches!(
        p.runtime.layer_ready(&req, 5, 0..1),
        Err(RuntimeError::Geometry(_))
    ));
    assert_eq!(p.runtime.stats().bytes_written, 0);
}

#[test]
fn chunked_prefill_grows_the_source_block_list() {
    let (layers, blocks, bb) = (2, 8, 4096);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-chunked");
    let dst_blocks = vec![7, 6, 5, 4];
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst_blocks.clone(), 1)
        .unwrap();
    producer.runtime.producer_handshake(hs).unwrap();
    producer
        .runtime
        .producer_open(req.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 0..2).unwrap();
    }
    // The second chunk brings two more blocks; a block listed twice in it
    // is refused.
    assert!(matches!(
        producer.runtime.producer_add_blocks(&req, vec![5, 5]),
        Err(RuntimeError::Geometry(_))
    ));
    producer.runtime.producer_add_blocks(&req, vec![2, 3]).unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 2..4).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(matches!(ev, RuntimeEvent::ConsumerCompleted { .. }), "{ev:?}");
    for l in 0..layers {
        for (i, &d) in dst_blocks.iter().enumerate() {
            assert_eq!(
                block(&consumer, l, d),
                block(&producer, l, i as u32),
                "layer {l} block {d}"
            );
        }
        for b in 0..4 {
            assert_untouched(&consumer, l, b);
        }
    }
}

#[test]
fn blocks_the_consumer_already_holds_are_not_written() {
    let (layers, blocks, bb) = (2, 8, 4096);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-prefix-hit");
    // The consumer holds request block 0 from its prefix cache; it
    // authorizes blocks 3 and 4 for request blocks 1 and 2.
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 1, vec![3, 4], 1)
        .unwrap();
    producer
        .runtime
        .producer_open(req.clone(), vec![5, 6, 7], cap(), 1)
        .unwrap();
    producer.runtime.producer_handshake(hs).unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(
        matches!(ev, RuntimeEvent::ConsumerCompleted { bytes, .. } if bytes == 2 * 2 * bb),
        "{ev:?}"
    );
    for l in 0..layers {
        assert_eq!(block(&consumer, l, 3), block(&producer, l, 6));
        assert_eq!(block(&consumer, l, 4), block(&producer, l, 7));
        for b in [0, 1, 2, 5, 6, 7] {
            assert_untouched(&consumer, l, b);
        }
    }
}

#[test]
fn blocks_descending_on_both_sides_go_as_one_range_per_run_and_land_byte_for_byte() {
    // What a cycled vLLM block pool hands out: runs of descending IDs on
    // both instances (it frees a request's blocks in reverse order).
    let (layers, blocks, bb) = (3, 32, 4096);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-descending");
    let src_blocks = vec![20, 19, 18, 17, 16, 3, 4, 30, 29];
    let dst_blocks = vec![11, 10, 9, 8, 7, 25, 26, 1, 0];
    let n = src_blocks.len() as u32;
    let ev = stream_whole(&producer, &consumer, &req, &src_blocks, &dst_blocks, layers);
    assert!(
        matches!(ev, RuntimeEvent::ConsumerCompleted { bytes, .. } if bytes == layers as u64 * n as u64 * bb),
        "{ev:?}"
    );
    let pairs: Vec<(u32, u32)> = src_blocks
        .iter()
        .copied()
        .zip(dst_blocks.iter().copied())
        .collect();
    assert_only_pairs_written(&producer, &consumer, layers, blocks, &pairs);
    // Three runs per layer (20..16 -> 11..7 down, 3..4 -> 25..26 up,
    // 30..29 -> 1..0 down), not nine blocks.
    let s = producer.runtime.stats();
    assert_eq!(s.write_ranges, 3 * layers as u64);
    assert_eq!(s.bytes_written, layers as u64 * n as u64 * bb);
}

#[test]
fn many_requests_streamed_at_once_land_byte_for_byte_in_grouped_batches() {
    // One writer lane: while its batch is in flight, the other requests'
    // layer writes queue and go out together (group commit). Whatever the
    // grouping, every request's bytes land in its own blocks only.
    let (layers, blocks, bb) = (4, 64, 2048);
    let cfg = orbitkv::RuntimeConfig {
        writer_lanes_per_peer: 1,
        consumer_timeout: Duration::from_secs(20),
        ..orbitkv::RuntimeConfig::default()
    };
    let producer = orbitkv::testing::host_rank_with(layers, blocks, bb, (0, 1), 2, src_pattern, cfg.clone());
    let consumer = orbitkv::testing::host_rank_with(layers, blocks, bb, (0, 1), 2, |_| GUARD, cfg);
    // Six requests of five blocks: sources 0.., destinations scattered
    // (every other block, descending), so each layer write is 3-5 ranges.
    let reqs: Vec<(RequestId, Vec<u32>, Vec<u32>)> = (0..6u32)
        .map(|r| {
            let src: Vec<u32> = (r * 5..r * 5 + 5).collect();
            let dst: Vec<u32> = (0..5).map(|i| 62 - 2 * (r * 5 + i)).collect();
            (RequestId::new(format!("req-grouped-{r}")), src, dst)
        })
        .collect();
    for (req, src, dst) in &reqs {
        let hs = consumer
            .runtime
            .consumer_open(req.clone(), cap(), 0, dst.clone(), 1)
            .unwrap();
        producer
            .runtime
            .producer_open(req.clone(), src.clone(), cap(), 1)
            .unwrap();
        producer.runtime.producer_handshake(hs).unwrap();
    }
    for l in 0..layers {
        for (req, _, _) in &reqs {
            producer.runtime.layer_ready(req, l, 0..5).unwrap();
        }
    }
    for (req, _, _) in &reqs {
        producer.runtime.producer_finish(req).unwrap();
    }
    for _ in &reqs {
        assert!(matches!(
            outcome(&consumer.runtime),
            RuntimeEvent::ConsumerCompleted { .. }
        ));
    }
    let pairs: Vec<(u32, u32)> = reqs
        .iter()
        .flat_map(|(_, src, dst)| src.iter().copied().zip(dst.iter().copied()))
        .collect();
    assert_only_pairs_written(&producer, &consumer, layers, blocks, &pairs);
    let s = producer.runtime.stats();
    assert_eq!(s.layers_written, layers as u64 * 6);
    // Every write either began a batch or rode in one.
    assert_eq!(s.write_batches + s.writes_grouped, layers as u64 * 6);
    assert_eq!(producer.runtime.writes_queued(), 0);
}

#[test]
fn a_layer_with_thousands_of_scattered_blocks_goes_out_in_several_batches() {
    // 4096 blocks that cannot be coalesced: one range each. Mooncake's TCP
    // transport refuses more than 1024 queued transfers per peer, so the
    // layer writer must split the layer under its range budget.
    let (layers, blocks, bb) = (4, 4096, 256);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-scattered");
    let src_blocks: Vec<u32> = (0..blocks).collect();
    // Reversed, and only every other block: no two ranges are adjacent.
    let dst_blocks: Vec<u32> = (0..blocks / 2).rev().map(|b| b * 2).collect();
    let n = dst_blocks.len() as u32;
    // All layers at once: 4 x 2048 ranges would be in flight unbounded.
    let ev = stream_whole(
        &producer,
        &consumer,
        &req,
        &src_blocks[..n as usize],
        &dst_blocks,
        layers,
    );
    assert!(
        matches!(ev, RuntimeEvent::ConsumerCompleted { bytes, .. } if bytes == layers as u64 * n as u64 * bb),
        "{ev:?}"
    );
    for l in 0..layers {
        for (i, &d) in dst_blocks.iter().enumerate() {
            assert_eq!(
                block(&consumer, l, d),
                block(&producer, l, i as u32),
                "layer {l} block {d}"
            );
            assert_untouched(&consumer, l, d + 1);
        }
    }
    // One admitted write per layer, each reported once, although each took
    // several batches.
    assert_eq!(producer.runtime.stats().layers_written, layers as u64);
}

#[test]
fn a_cancelled_request_releases_its_source_blocks_without_waiting_for_a_handshake() {
    let producer = rank(2, 8, 4096, (0, 1), 2, src_pattern);
    // Cancelled while open: released at once, outcome aborted.
    let open = RequestId::new("req-cancel-open");
    producer
        .runtime
        .producer_open(open.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    producer.runtime.layer_ready(&open, 0, 0..2).unwrap();
    producer
        .runtime
        .producer_cancel(&orbitkv::Cancel::new(open.clone(), cap(), "client went away"))
        .unwrap();
    let ev = wait_for(&producer.runtime, "release", |e| {
        matches!(e, RuntimeEvent::ProducerReleased { .. })
    });
    assert!(
        matches!(ev, RuntimeEvent::ProducerReleased { outcome: Outcome::Aborted, ref request, .. } if *request == open),
        "{ev:?}"
    );
    // Cancelled before it opened: released as soon as it opens.
    let early = RequestId::new("req-cancel-early");
    producer
        .runtime
        .producer_cancel(&orbitkv::Cancel::new(early.clone(), cap(), "client went away"))
        .unwrap();
    producer
        .runtime
        .producer_open(early.clone(), vec![2, 3], cap(), 1)
        .unwrap();
    let ev = wait_for(&producer.runtime, "release", |e| {
        matches!(e, RuntimeEvent::ProducerReleased { .. })
    });
    assert!(
        matches!(ev, RuntimeEvent::ProducerReleased { outcome: Outcome::Aborted, ref request, .. } if *request == early),
        "{ev:?}"
    );
    assert_eq!(producer.runtime.live_requests(), (0, 0));
    assert_eq!(producer.runtime.stats().bytes_written, 0);
}

#[test]
fn an_unclaimed_producer_is_given_up_and_a_claimed_one_writes_on() {
    // Issue 44: prefill halves no decode claims must not hold their blocks
    // until the handshake deadline once the scheduler says so.
    let (layers, bb) = (2, 4096);
    let producer = rank(layers, 8, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, 8, bb, (0, 1), 2, |_| GUARD);
    let lone = RequestId::new("req-unclaimed");
    producer
        .runtime
        .producer_open(lone.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&lone, l, 0..2).unwrap();
    }
    producer.runtime.producer_finish(&lone).unwrap();
    producer
        .runtime
        .producer_release_unclaimed(&lone, "no decode claimed it")
        .unwrap();
    let (how, why) = wait_released(&producer.runtime, &lone);
    assert_eq!(
        (how, why.as_deref()),
        (Outcome::Aborted, Some("no decode claimed it"))
    );
    assert_eq!(producer.runtime.stats().producers_unclaimed_released, 1);
    // Its decode claims it only now (vllm-router's flow under load): the
    // handshake is answered `aborted` at once, not parked until the
    // consumer's deadline, and nothing is written.
    let start = Instant::now();
    let late = consumer
        .runtime
        .consumer_open(lone.clone(), cap(), 0, vec![6, 7], 1)
        .unwrap();
    producer.runtime.producer_handshake(late).unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(
        matches!(&ev, RuntimeEvent::ConsumerFailed { reason, .. }
            if reason.contains("prefill gave the request up: no decode claimed it")),
        "{ev:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
    consumer.runtime.consumer_release(&lone).unwrap();
    wait_for(&consumer.runtime, "release", |e| {
        matches!(e, RuntimeEvent::ConsumerReleased { .. })
    });
    assert_untouched(&consumer, 0, 6);
    assert_untouched(&consumer, 1, 7);
    // Claimed (its handshake came): the ask changes nothing, the KV lands.
    let req = RequestId::new("req-claimed");
    let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, &req, &[2, 3], &[4, 5]);
    producer.runtime.producer_handshake(hs).unwrap();
    producer
        .runtime
        .producer_release_unclaimed(&req, "no decode claimed it")
        .unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 0..2).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    assert!(matches!(
        outcome(&consumer.runtime),
        RuntimeEvent::ConsumerCompleted { .. }
    ));
    assert_only_pairs_written(&producer, &consumer, layers, 8, &[(2, 4), (3, 5)]);
    assert_eq!(producer.runtime.stats().producers_unclaimed_released, 1);
    // Released already: the ask is an unknown request, a typed error.
    assert!(matches!(
        producer.runtime.producer_release_unclaimed(&lone, "again"),
        Err(RuntimeError::UnknownRequest(_))
    ));
}

#[test]
fn a_request_prefill_gave_up_before_opening_fails_its_consumer_at_once() {
    // Both orders: the handshake parked first, then the discard; and the
    // discard first, then the handshake. Either way the consumer fails well
    // inside its 20 s deadline, and nothing is written.
    for handshake_first in [true, false] {
        let producer = rank(2, 8, 4096, (0, 1), 2, src_pattern);
        let consumer = rank(2, 8, 4096, (0, 1), 2, |_| GUARD);
        let req = RequestId::new("req-discarded");
        let hs = consumer
            .runtime
            .consumer_open(req.clone(), cap(), 0, vec![1, 2], 1)
            .unwrap();
        let start = Instant::now();
        if handshake_first {
            producer.runtime.producer_handshake(hs).unwrap();
            producer
                .runtime
                .producer_discard(&req, &cap(), "aborted while queued")
                .unwrap();
        } else {
            producer
                .runtime
                .producer_discard(&req, &cap(), "aborted while queued")
                .unwrap();
            producer.runtime.producer_handshake(hs).unwrap();
        }
        let ev = outcome(&consumer.runtime);
        assert!(
            matches!(&ev, RuntimeEvent::ConsumerFailed { reason, .. } if reason.contains("prefill gave the request up")),
            "{ev:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());
        consumer.runtime.consumer_release(&req).unwrap();
        wait_for(&consumer.runtime, "release", |e| {
            matches!(e, RuntimeEvent::ConsumerReleased { .. })
        });
        assert_untouched(&consumer, 0, 1);
        assert_untouched(&consumer, 1, 2);
        assert_eq!(consumer.runtime.live_requests(), (0, 0));
    }
}

#[test]
fn one_producer_rank_fills_two_consumer_ranks_each_with_its_heads() {
    // Prefill TP 1 holds both KV heads (1 KiB each per block); decode TP 2
    // holds one per rank. The one producer sends each decode rank its head
    // under that rank's own authorization and generation, and is released
    // once, after both.
    let (layers, blocks, hb) = (2, 8, 1024u64);
    let producer = rank(layers, blocks, 2 * hb, (0, 1), 2, src_pattern);
    let c0 = rank(layers, blocks, hb, (0, 2), 2, |_| GUARD);
    let c1 = rank(layers, blocks, hb, (1, 2), 2, |_| GUARD);
    let req = RequestId::new("req-1-to-2");
    let src = vec![1, 2, 3];
    let dst = [vec![4, 5, 6], vec![7, 0, 2]];
    let h0 = c0
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst[0].clone(), 1)
        .unwrap();
    let h1 = c1
        .runtime
        .consumer_open(req.clone(), cap(), 0, dst[1].clone(), 1)
        .unwrap();
    assert_eq!((h0.expected_producers, h1.expected_producers), (1, 1));
    producer.runtime.producer_handshake(h1).unwrap(); // parked before the open
    producer
        .runtime
        .producer_open(req.clone(), src.clone(), cap(), 2)
        .unwrap();
    producer.runtime.producer_handshake(h0).unwrap(); // after it
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    for (c, consumer) in [&c0, &c1].into_iter().enumerate() {
        let ev = outcome(&consumer.runtime);
        assert!(
            matches!(ev, RuntimeEvent::ConsumerCompleted { .. }),
            "rank {c}: {ev:?}"
        );
        for l in 0..layers {
            for b in 0..blocks {
                match dst[c].iter().position(|&d| d == b) {
                    Some(i) => {
                        let head = &block(&producer, l, src[i])[c * hb as usize..(c + 1) * hb as usize];
                        assert_eq!(block(consumer, l, b), head, "rank {c} layer {l} block {b}");
                    }
                    None => assert_untouched(consumer, l, b),
                }
            }
        }
    }
    let released: Vec<_> = (0..3)
        .filter_map(|_| producer.runtime.next_event(Duration::from_millis(500)))
        .filter(|e| matches!(e, RuntimeEvent::ProducerReleased { .. }))
        .collect();
    assert_eq!(released.len(), 1, "{released:?}");
    assert!(matches!(
        released[0],
        RuntimeEvent::ProducerReleased {
            outcome: Outcome::Done,
            ..
        }
    ));
    assert_eq!(producer.runtime.live_requests(), (0, 0));
}

#[test]
fn a_rank_holding_only_replicas_is_released_at_once_and_refuses_handshakes() {
    // One KV head replicated on prefill TP 2: rank 1 never sends.
    let p1 = rank(1, 8, 256, (1, 2), 1, src_pattern);
    let consumer = rank(1, 8, 256, (0, 1), 1, |_| GUARD);
    let req = RequestId::new("req-replica");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1], 2)
        .unwrap();
    assert_eq!(hs.expected_producers, 1);
    p1.runtime.producer_open(req.clone(), vec![0], cap(), 1).unwrap();
    let (done, why) = wait_released(&p1.runtime, &req);
    assert_eq!(done, Outcome::Done, "{why:?}");
    assert!(matches!(
        p1.runtime.producer_handshake(hs),
        Err(RuntimeError::Geometry(_))
    ));
    assert!(matches!(
        p1.runtime.layer_ready(&req, 0, 0..1),
        Err(RuntimeError::UnknownRequest(_))
    ));
}

#[test]
fn a_consumer_told_the_wrong_prefill_tp_is_refused() {
    // Decode thinks prefill has TP 1 (expects one producer) but the prefill
    // rank is one of two: its handshake is refused with the reason.
    let consumer = rank(1, 8, 512, (0, 1), 2, |_| GUARD);
    let p0 = rank(1, 8, 256, (0, 2), 2, src_pattern);
    let hs = consumer
        .runtime
        .consumer_open(RequestId::new("req-wrong-tp"), cap(), 0, vec![1], 1)
        .unwrap();
    let err = p0.runtime.producer_handshake(hs).unwrap_err();
    assert!(
        err.to_string().contains("orbitkv_prefill_tp does not match"),
        "{err}"
    );
}

#[test]
fn a_refused_handshake_fails_its_rank_now_and_a_stale_refusal_changes_nothing() {
    let consumer = rank(1, 8, 256, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-refused");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1], 1)
        .unwrap();
    let stale = Generation(hs.generation.0 - 1);
    assert!(matches!(
        consumer.runtime.consumer_handshake_refused(&req, stale, 0, "old"),
        Err(RuntimeError::StaleGeneration { .. })
    ));
    assert!(consumer.runtime.next_event(Duration::from_millis(300)).is_none());
    let start = Instant::now();
    consumer
        .runtime
        .consumer_handshake_refused(&req, hs.generation, 0, "403 ForbiddenError")
        .unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(
        matches!(&ev, RuntimeEvent::ConsumerFailed { reason, .. } if reason.contains("refused the handshake")),
        "{ev:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    assert!(matches!(
        consumer
            .runtime
            .consumer_handshake_refused(&RequestId::new("nobody"), hs.generation, 0, "x"),
        Err(RuntimeError::UnknownRequest(_))
    ));
}

#[test]
fn a_handshake_published_where_nothing_listens_fails_its_rank_at_once() {
    let consumer = rank(1, 8, 256, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-nobody");
    let hs = consumer
        .runtime
        .consumer_open(req.clone(), cap(), 0, vec![1], 1)
        .unwrap();
    let start = Instant::now();
    consumer
        .runtime
        .consumer_publish(&hs, vec![("127.0.0.1:1".into(), 0)])
        .unwrap();
    let ev = outcome(&consumer.runtime);
    assert!(
        matches!(&ev, RuntimeEvent::ConsumerFailed { reason, .. } if reason.contains("nothing listens")),
        "{ev:?}"
    );
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn a_cancel_racing_the_open_is_never_lost() {
    // The cancel and the open come from two threads at once, many times: the
    // producer is always aborted (before the fix, a cancel that checked for
    // the producer just before it opened was lost until the deadline).
    let producer = rank(1, 64, 256, (0, 1), 2, src_pattern);
    for i in 0..50u32 {
        let req = RequestId::new(format!("race-{i}"));
        std::thread::scope(|s| {
            let (rt, r) = (&producer.runtime, req.clone());
            s.spawn(move || {
                rt.producer_cancel(&orbitkv::Cancel::new(r, cap(), "client left"))
                    .unwrap()
            });
            producer
                .runtime
                .producer_open(req.clone(), vec![i % 64], cap(), 1)
                .unwrap();
        });
        let ev = wait_for(&producer.runtime, "release", |e| {
            matches!(e, RuntimeEvent::ProducerReleased { .. })
        });
        assert!(
            matches!(&ev, RuntimeEvent::ProducerReleased { outcome: Outcome::Aborted, request, .. } if *request == req),
            "{ev:?}"
        );
    }
    assert_eq!(producer.runtime.live_requests(), (0, 0));
}

/// Two prefill ranks (TP 2) serve several requests in a row to one decode
/// rank (TP 1), both ranks writing at once: every request completes with the
/// right bytes (the vLLM TP 2 → 1 runs stalled after their first request).
#[test]
fn two_producer_ranks_serve_requests_in_a_row_to_one_consumer() {
    let (layers, blocks, hb) = (4, 64, 1024u64);
    let consumer = rank(layers, blocks, 4 * hb, (0, 1), 4, |_| GUARD);
    let p0 = rank(layers, blocks, 2 * hb, (0, 2), 4, src_pattern);
    let p1 = rank(layers, blocks, 2 * hb, (1, 2), 4, |i| src_pattern(i + 7));
    for n in 0..6u32 {
        let req = RequestId::new(format!("req-row-{n}"));
        let src_blocks: Vec<u32> = (0..4).map(|i| (n * 4 + i) % blocks).collect();
        let dst_blocks: Vec<u32> = (0..4).map(|i| (n * 8 + 2 * i + 1) % blocks).collect();
        let hs = consumer
            .runtime
            .consumer_open(req.clone(), cap(), 0, dst_blocks.clone(), 2)
            .unwrap();
        let started = Instant::now();
        std::thread::scope(|s| {
            for p in [&p0, &p1] {
                let (req, hs, src) = (req.clone(), hs.clone(), src_blocks.clone());
                s.spawn(move || {
                    p.runtime.producer_open(req.clone(), src, cap(), 1).unwrap();
                    for l in 0..layers {
                        p.runtime.layer_ready(&req, l, 0..4).unwrap();
                    }
                    p.runtime.producer_handshake(hs).unwrap();
                    p.runtime.producer_finish(&req).unwrap();
                });
            }
        });
        let ev = outcome(&consumer.runtime);
        assert!(
            matches!(ev, RuntimeEvent::ConsumerCompleted { .. }),
            "request {n}: {ev:?} after {:?}",
            started.elapsed()
        );
        for p in [&p0, &p1] {
            wait_for(&p.runtime, "producer release", |e| {
                matches!(
                    e,
                    RuntimeEvent::ProducerReleased {
                        outcome: Outcome::Done,
                        ..
                    }
                )
            });
        }
        for l in 0..layers {
            for (i, &b) in dst_blocks.iter().enumerate() {
                let got = block(&consumer, l, b);
                let s = src_blocks[i];
                assert_eq!(
                    &got[..2 * hb as usize],
                    block(&p0, l, s),
                    "req {n} layer {l} block {b}"
                );
                assert_eq!(
                    &got[2 * hb as usize..],
                    block(&p1, l, s),
                    "req {n} layer {l} block {b}"
                );
            }
        }
        consumer.runtime.consumer_release(&req).unwrap();
        wait_for(&consumer.runtime, "consumer release", |e| {
            matches!(e, RuntimeEvent::ConsumerReleased { .. })
        });
    }
}

/// vLLM's hybrid KV cache manager (issue 46): a full-attention group and a
/// sliding-window group, each layer of one sharing its tensor with a layer
/// of the other, and one block table per group. Decode holds no block for
/// the window's first request block (vLLM's null block, a hole): each
/// layer is written from and into its own group's blocks only, the hole and
/// every block outside the tables stay untouched, and the source block
/// behind the hole is never read into anything.
#[test]
fn a_hybrid_model_is_written_group_by_group_and_a_window_hole_is_left_alone() {
    use orbitkv::HOLE;
    // Layers 0, 1: full attention (group 0, tensors 0, 1); layers 2, 3:
    // sliding window (group 1), sharing tensors 0 and 1.
    let layers = [(0, 0), (0, 1), (1, 0), (1, 1)];
    let p = orbitkv::testing::host_rank_grouped(&layers, 2, 16, 256, src_pattern);
    let c = orbitkv::testing::host_rank_grouped(&layers, 2, 16, 256, |_| GUARD);
    assert_eq!(p.layout.groups(), 2);
    let req = RequestId::new("req-hybrid");
    // Three request blocks: group 0 then group 1 (group-major tables).
    let src = [1, 2, 3, 4, 5, 6];
    let dst = [7, 8, 9, HOLE, 10, 11];
    let hs = orbitkv::testing::open_both(&p.runtime, &c.runtime, &req, &src, &dst);
    p.runtime.producer_handshake(hs).unwrap();
    for l in 0..4 {
        p.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    p.runtime.producer_finish(&req).unwrap();
    let got = outcome(&c.runtime);
    assert!(matches!(got, RuntimeEvent::ConsumerCompleted { .. }), "{got:?}");
    // Tensor t is written by layer t (group 0) in blocks 7..9 and by layer
    // 2 + t (group 1) in blocks 10, 11.
    for t in 0..2 {
        for (s, d) in [(1, 7), (2, 8), (3, 9), (5, 10), (6, 11)] {
            assert_eq!(block(&c, t, d), block(&p, t, s), "tensor {t} block {d}");
        }
        for b in (0..16).filter(|b| ![7, 8, 9, 10, 11].contains(b)) {
            assert_untouched(&c, t, b);
        }
    }
    assert_eq!(wait_released(&p.runtime, &req).0, Outcome::Done);
}

/// A block table that is not one equal segment a group, a group whose
/// layers the other side puts in another group, and a block listed in two
/// groups are refused with typed errors, and nothing is written.
#[test]
fn hybrid_tables_and_groups_that_do_not_match_are_refused() {
    use orbitkv::HOLE;
    let layers = [(0, 0), (1, 0)];
    let p = orbitkv::testing::host_rank_grouped(&layers, 1, 8, 64, src_pattern);
    let c = orbitkv::testing::host_rank_grouped(&layers, 1, 8, 64, |_| GUARD);
    let r = |s: &str| RequestId::new(s);
    let uneven = c.runtime.consumer_open(r("a"), cap(), 0, vec![1, 2, 3], 1);
    assert!(matches!(uneven, Err(RuntimeError::Geometry(_))), "{uneven:?}");
    let twice = c.runtime.consumer_open(r("b"), cap(), 0, vec![1, 1], 1);
    assert!(matches!(twice, Err(RuntimeError::Geometry(_))), "{twice:?}");
    let twice = p.runtime.producer_open(r("b"), vec![2, 2], cap(), 1);
    assert!(matches!(twice, Err(RuntimeError::Geometry(_))), "{twice:?}");
    // Holes are not duplicates.
    c.runtime
        .consumer_open(r("c"), cap(), 0, vec![HOLE, 3, HOLE, 4], 1)
        .unwrap();
    // A producer whose layers sit in other groups than the consumer's.
    let other = orbitkv::testing::host_rank_grouped(&[(0, 0), (0, 1)], 2, 8, 64, src_pattern);
    let hs = c.runtime.consumer_open(r("d"), cap(), 0, vec![5, 6], 1).unwrap();
    other.runtime.producer_open(r("d"), vec![1], cap(), 1).unwrap();
    let refused = other.runtime.producer_handshake(hs);
    assert!(matches!(refused, Err(RuntimeError::Geometry(_))), "{refused:?}");
    for b in 0..8 {
        assert_untouched(&c, 0, b);
    }
}

/// A source block vLLM freed and gave back to the same request (a sliding
/// window's, in reality) leaves a hole at its old place. Where decode holds
/// no block there, nothing is lost; where it does, the layer fails and the
/// request with it: decode recomputes, it never reads a block nobody wrote.
#[test]
fn a_source_block_given_back_fails_a_layer_decode_needs_from_it_and_writes_nothing_wrong() {
    let (layers, blocks, bb) = (1, 8, 1024);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let req = RequestId::new("req-given-back");
    let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, &req, &[0, 1], &[7, 6, 5]);
    producer.runtime.producer_handshake(hs).unwrap();
    // Block 1 comes back as request block 2: request block 1 is now a hole.
    producer.runtime.producer_add_blocks(&req, vec![1]).unwrap();
    // Request block 1 reported (again): decode needs it, nobody holds it.
    producer.runtime.layer_ready(&req, 0, 1..3).unwrap();
    // The failed write may have ended the producer already (UnknownRequest).
    let _ = producer.runtime.producer_finish(&req);
    let ev = outcome(&consumer.runtime);
    assert!(matches!(ev, RuntimeEvent::ConsumerFailed { .. }), "{ev:?}");
    assert_untouched(&consumer, 0, 6);
    assert_ne!(wait_released(&producer.runtime, &req).0, Outcome::Done);
}

/// Prefill of 4-token blocks, decode of 8-token blocks, vLLM's CPU token
/// order (a head's K transposed, then its V), through real Mooncake: every
/// token decode loads lands where decode keeps it, byte for byte; the
/// bytes past the last token and every other block stay untouched; a
/// prefill that stops reporting before the last token fails the request.
#[test]
fn blocks_of_another_size_are_written_token_by_token_through_mooncake() {
    use orbitkv::layout::{TokenOrder, TokenPart};
    let order = TokenOrder {
        units: 2,
        parts: vec![
            TokenPart {
                rows: 4,
                token_bytes: 2,
            },
            TokenPart {
                rows: 1,
                token_bytes: 8,
            },
        ],
    };
    let p = orbitkv::testing::host_rank_tokens(2, 16, 4, order.clone(), 2, src_pattern);
    let c = orbitkv::testing::host_rank_tokens(2, 8, 8, order, 2, |_| GUARD);
    let (src, dst) = ([3u32, 9, 4, 5, 12, 0, 7], [6u32, 1, 2, 7]);
    let req = RequestId::new("req-block-sizes");
    let hs = c
        .runtime
        .consumer_open_tokens(req.clone(), cap(), 0, dst.to_vec(), 1, 27)
        .unwrap();
    p.runtime
        .producer_open(req.clone(), src.to_vec(), cap(), 1)
        .unwrap();
    p.runtime.producer_handshake(hs).unwrap();
    // Two chunks, the second resending the partial block that ends the first.
    for l in 0..2 {
        p.runtime.layer_ready(&req, l, 0..3).unwrap();
        p.runtime.layer_ready(&req, l, 2..7).unwrap();
    }
    p.runtime.producer_finish(&req).unwrap();
    let got = outcome(&c.runtime);
    assert!(matches!(got, RuntimeEvent::ConsumerCompleted { .. }), "{got:?}");
    assert_eq!(wait_released(&p.runtime, &req).0, Outcome::Done);
    // Byte `i` of row `r` of part `k` of head `h`, token `t` of a block of
    // `bs` tokens (16 bytes a token and head: 4 rows of 2, 1 row of 8).
    let at = |bs: usize, h: usize, k: usize, r: usize, t: usize, i: usize| {
        let unit = bs * 16;
        let (part, tb) = if k == 0 { (0, 2) } else { (bs * 8, 8) };
        h * unit + part + (r * bs + t) * tb + i
    };
    for l in 0..2 {
        for t in 0..32 {
            let d = block(&c, l, dst[t / 8]);
            for h in 0..2 {
                for (k, rows, tb) in [(0, 4, 2), (1, 1, 8)] {
                    for r in 0..rows {
                        for i in 0..tb {
                            let got = d[at(8, h, k, r, t % 8, i)];
                            if t < 27 {
                                let s = block(&p, l, src[t / 4]);
                                assert_eq!(got, s[at(4, h, k, r, t % 4, i)], "layer {l} token {t}");
                            } else {
                                assert_eq!(got, GUARD, "layer {l}: token {t} is past the prompt");
                            }
                        }
                    }
                }
            }
        }
        for b in (0..8).filter(|b| !dst.contains(b)) {
            assert_untouched(&c, l, b);
        }
    }
    // A prefill that reports blocks 0..6 (24 of the 27 tokens) and finishes.
    let req = RequestId::new("req-block-sizes-short");
    let hs = c
        .runtime
        .consumer_open_tokens(req.clone(), cap(), 0, vec![3, 4, 5, 0], 1, 27)
        .unwrap();
    p.runtime
        .producer_open(req.clone(), src.to_vec(), cap(), 1)
        .unwrap();
    p.runtime.producer_handshake(hs).unwrap();
    for l in 0..2 {
        p.runtime.layer_ready(&req, l, 0..6).unwrap();
    }
    p.runtime.producer_finish(&req).unwrap();
    let got = outcome(&c.runtime);
    assert!(matches!(got, RuntimeEvent::ConsumerFailed { .. }), "{got:?}");
}

/// The durations of a request's phases (`Runtime::take_timings`, vLLM's
/// histograms): the transfer's tail after vLLM finished the prefill, how
/// long the prefill's pages stayed held after it, and how long decode's
/// completion waited to be taken; and the two parts of the tail, decode's
/// handshake and the last write's first batch after the finish. Decode
/// authorizes 60 ms after the finish and the completion is taken 40 ms
/// after it came, so each duration is at least that; a request authorized
/// and sent before its finish has both parts 0; an aborted request is not
/// counted as written; each is taken once.
#[test]
fn the_time_after_the_prefill_finished_is_timed_on_both_sides() {
    let (layers, blocks, bb) = (2, 8, 4096);
    let producer = rank(layers, blocks, bb, (0, 1), 2, src_pattern);
    let consumer = rank(layers, blocks, bb, (0, 1), 2, |_| GUARD);
    let of = |t: &[(orbitkv::Timing, Vec<u32>)], w: orbitkv::Timing| {
        t.iter().find(|(x, _)| *x == w).map(|(_, v)| v.clone()).unwrap()
    };
    let req = RequestId::new("timed");
    let hs = orbitkv::testing::open_both(&producer.runtime, &consumer.runtime, &req, &[0, 1, 2], &[3, 4, 5]);
    for l in 0..layers {
        producer.runtime.layer_ready(&req, l, 0..3).unwrap();
    }
    producer.runtime.producer_finish(&req).unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let authorized = Instant::now();
    producer.runtime.producer_handshake(hs).unwrap();
    let (done, why) = wait_released(&producer.runtime, &req);
    assert_eq!(done, Outcome::Done, "{why:?}");
    let since_authorized = authorized.elapsed();
    // the completion (the notice goes after the release) waits 40 ms
    // before the worker takes it
    let until = Instant::now() + Duration::from_secs(5);
    while consumer.runtime.stats().consumers_completed == 0 || producer.runtime.stats().notices_sent == 0 {
        assert!(Instant::now() < until, "decode never completed");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(40));
    assert!(matches!(
        outcome(&consumer.runtime),
        RuntimeEvent::ConsumerCompleted { .. }
    ));
    let p = producer.runtime.take_timings();
    let (written, pages) = (
        of(&p, orbitkv::Timing::WrittenAfterFinish),
        of(&p, orbitkv::Timing::PagesHeldAfterFinish),
    );
    assert_eq!((written.len(), pages.len()), (1, 1), "{p:?}");
    // both from the finish, the pages back at the release (after the last
    // write), the written time once the notice was sent
    assert!(written[0] >= 60_000 && pages[0] >= 60_000, "{p:?}");
    let span = (Duration::from_millis(60) + since_authorized).as_micros() + 50_000;
    assert!(u128::from(pages[0]) <= span, "{p:?}");
    // where the tail went: decode's handshake 60 ms after the finish (less
    // the time the actor took to handle the finish, stamped then), the
    // lane finding the last layer computed (no GPU mark here: when the
    // write reached it, after the handshake), the last write's first
    // batch after that, all within the written time
    let (shaken, computed, sent) = (
        of(&p, orbitkv::Timing::HandshakeAfterFinish),
        of(&p, orbitkv::Timing::ComputedAfterFinish),
        of(&p, orbitkv::Timing::SentAfterFinish),
    );
    assert_eq!((shaken.len(), computed.len(), sent.len()), (1, 1, 1), "{p:?}");
    assert!(
        shaken[0] >= 50_000 && shaken[0] <= computed[0] && computed[0] <= sent[0] && sent[0] <= written[0],
        "{p:?}"
    );
    assert!(
        of(&p, orbitkv::Timing::CompleteToTaken).is_empty(),
        "prefill completes nothing"
    );
    let c = consumer.runtime.take_timings();
    let taken = of(&c, orbitkv::Timing::CompleteToTaken);
    assert_eq!(taken.len(), 1, "{c:?}");
    assert!(taken[0] >= 40_000, "{c:?}");
    assert!(of(&c, orbitkv::Timing::WrittenAfterFinish).is_empty());
    // taken once
    assert!(producer.runtime.take_timings().iter().all(|(_, v)| v.is_empty()));
    assert!(consumer.runtime.take_timings().iter().all(|(_, v)| v.is_empty()));

    // finished, then aborted before decode authorized: nothing written, the
    // pages held until the release are timed
    let gone = RequestId::new("timed-abort");
    producer
        .runtime
        .producer_open(gone.clone(), vec![0, 1], cap(), 1)
        .unwrap();
    producer.runtime.producer_finish(&gone).unwrap();
    producer.runtime.producer_abort(&gone, "client left").unwrap();
    let (ended, _) = wait_released(&producer.runtime, &gone);
    assert_eq!(ended, Outcome::Aborted);
    let p = producer.runtime.take_timings();
    assert!(of(&p, orbitkv::Timing::WrittenAfterFinish).is_empty(), "{p:?}");
    assert_eq!(of(&p, orbitkv::Timing::PagesHeldAfterFinish).len(), 1, "{p:?}");
    assert!(of(&p, orbitkv::Timing::HandshakeAfterFinish).is_empty(), "{p:?}");
    assert!(of(&p, orbitkv::Timing::SentAfterFinish).is_empty(), "{p:?}");
    assert!(of(&p, orbitkv::Timing::ComputedAfterFinish).is_empty(), "{p:?}");

    // the streaming flow's order: decode authorized and every layer sent
    // before vLLM finished: both parts of the tail are 0
    let early = RequestId::new("timed-early");
    let before = producer.runtime.stats().layers_written;
    let hs = orbitkv::testing::open_both(
        &producer.runtime,
        &consumer.runtime,
        &early,
        &[0, 1, 2],
        &[3, 4, 5],
    );
    producer.runtime.producer_handshake(hs).unwrap();
    for l in 0..layers {
        producer.runtime.layer_ready(&early, l, 0..3).unwrap();
    }
    let until = Instant::now() + Duration::from_secs(5);
    while producer.runtime.stats().layers_written < before + layers as u64 {
        assert!(Instant::now() < until, "the early writes never ended");
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
    producer.runtime.producer_finish(&early).unwrap();
    let (done, why) = wait_released(&producer.runtime, &early);
    assert_eq!(done, Outcome::Done, "{why:?}");
    let p = producer.runtime.take_timings();
    assert_eq!(of(&p, orbitkv::Timing::HandshakeAfterFinish), vec![0], "{p:?}");
    assert_eq!(of(&p, orbitkv::Timing::SentAfterFinish), vec![0], "{p:?}");
    assert_eq!(of(&p, orbitkv::Timing::ComputedAfterFinish), vec![0], "{p:?}");
}
