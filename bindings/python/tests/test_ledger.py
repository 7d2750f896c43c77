"""The worker's per-request ledger (orbitkv/vllm/ledger.py): records appear
on first use, disappear once empty, and the tombstones of released consumers
stay bounded."""

from __future__ import annotations

from orbitkv.vllm.ledger import ConsumerRecord, Ledger, ProducerRecord


def test_records_come_and_go_with_their_state() -> None:
    led = Ledger()
    assert led.peek_consumer("a") == ConsumerRecord()
    assert led.sizes()["consumers"] == 0, "peeking stores nothing"
    rec = led.consumer("a")
    rec.req_id, rec.blocks = "req-a", [1, 2]
    assert led.consumer("a") is rec
    rec.req_id = rec.blocks = None
    led.tidy_consumer("a")
    assert "a" not in led.consumers
    led.consumer("b").release_now = True
    led.consumer("b").req_id = "req-b"
    led.consumer("c").req_id = "req-c"
    assert list(led.release_now()) == ["b"]
    assert led.forget_consumer("b") == "req-b"
    assert led.forget_consumer("b") is None
    assert led.sizes() == {"consumers": 1, "producers": 0, "released_after_report": 0}


def test_only_producers_both_ended_and_released_are_handed_back() -> None:
    led = Ledger()
    led.producer("x").req_id = "rx"
    led.producer("x").released = True
    led.producer("y").req_id = "ry"
    led.producer("y").ended = True
    led.producer("z").req_id = "rz"
    led.producer("z").ended = led.producer("z").released = True
    assert [pd for pd, _ in led.ended_and_released()] == ["z"]
    led.producer("e")  # created by an abort, nothing in it
    led.tidy_producer("e")
    assert "e" not in led.producers
    assert led.peek_producer("nope") == ProducerRecord()


def test_the_tombstones_of_released_consumers_are_bounded() -> None:
    led = Ledger(released_after_report_cap=3)
    for i in range(10):
        led.remember_released_after_report(f"pd{i}", f"r{i}")
    assert list(led.released_after_report) == ["pd7", "pd8", "pd9"]
