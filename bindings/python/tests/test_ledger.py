"""The worker's per-request ledger (orbitkv/vllm/ledger.py): records appear
on first use, disappear once empty, and the tombstones of released consumers
stay bounded."""

from __future__ import annotations

from orbitkv.vllm.ledger import ConsumerRecord, Ledger, ProducerRecord


def test_records_come_and_go_with_their_state() -> None:
    led = Ledger()
    assert led.consumers.peek("a") == ConsumerRecord()
    assert led.sizes()["consumers"] == 0, "peeking stores nothing"
    rec = led.consumers.get("a")
    rec.req_id, rec.blocks = "req-a", [1, 2]
    assert led.consumers.get("a") is rec
    led.consumers.tidy("a")
    assert "a" in led.consumers, "a record with something in it stays"
    rec.req_id = rec.blocks = None
    led.consumers.tidy("a")
    assert "a" not in led.consumers
    led.consumers.get("b").release_now = True
    led.consumers.get("b").req_id = "req-b"
    led.consumers.get("c").req_id = "req-c"
    assert list(led.release_now()) == ["b"]
    popped = led.consumers.pop("b")
    assert popped is not None and popped.req_id == "req-b"
    assert led.consumers.pop("b") is None
    assert led.sizes() == {"consumers": 1, "producers": 0, "released_after_report": 0}


def test_only_producers_both_ended_and_released_are_handed_back() -> None:
    led = Ledger()
    led.producers.get("x").req_id = "rx"
    led.producers.get("x").released = True
    led.producers.get("y").req_id = "ry"
    led.producers.get("y").ended = True
    z = led.producers.get("z")
    z.req_id, z.ended, z.released = "rz", True, True
    assert [pd for pd, _ in led.ended_and_released()] == ["z"]
    led.producers.get("e")  # created by an abort, nothing in it
    led.producers.tidy("e")
    assert "e" not in led.producers
    assert led.producers.peek("nope") == ProducerRecord()


def test_the_tombstones_of_released_consumers_are_bounded() -> None:
    led = Ledger(released_after_report_cap=3)
    for i in range(10):
        led.remember_released_after_report(f"pd{i}", f"r{i}")
    assert list(led.released_after_report) == ["pd7", "pd8", "pd9"]
