"""Notifications between two engines on loopback."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from _util import wait_for_notifications

import orbitkv


def test_notifications_arrive_exactly_once(pair):
    a, b = pair
    b.take_notifications()  # drain what other tests may have left
    sent: list[tuple[str, str | bytes | bytearray | memoryview]] = [
        ("req-1", b"layer 0 done"),
        ("req-2", "text is sent as UTF-8: \u00e9"),
        ("req-1", bytearray(b"\x00\x01binary\x00")),
        ("req-3", memoryview(b"from a memoryview")),
        ("req-4", b""),
    ]
    for name, message in sent:
        a.send_notification(b.endpoint, name, message)
    got = wait_for_notifications(b, len(sent))
    expected = [
        (name, message.encode() if isinstance(message, str) else bytes(message)) for name, message in sent
    ]
    assert Counter(got) == Counter(expected)
    assert all(isinstance(n, str) and isinstance(m, bytes) for n, m in got)
    time.sleep(0.2)
    assert b.take_notifications() == [], "a notification was delivered twice"
    assert a.take_notifications() == [], "the sender received its own notification"


def test_large_notification_arrives_intact(pair):
    a, b = pair
    payload = ("layer \u00e9\u4e2d\x00" * 8192).encode()  # ~96 KiB of UTF-8, NULs included
    a.send_notification(b.endpoint, "big", payload)
    assert wait_for_notifications(b, 1) == [("big", payload)]


def test_non_utf8_message_is_refused_not_altered(pair):
    """Mooncake carries notifications as JSON text and would replace invalid
    UTF-8 in transit; the core refuses such messages instead."""
    a, b = pair
    with pytest.raises(orbitkv.InvalidArgumentError, match="UTF-8"):
        a.send_notification(b.endpoint, "bin", bytes(range(256)))
    time.sleep(0.1)
    assert b.take_notifications() == []


def test_notification_message_type(pair):
    a, b = pair
    with pytest.raises(TypeError):
        a.send_notification(b.endpoint, "x", 123)


def test_notification_to_unreachable_peer(pair):
    a, _ = pair
    with pytest.raises(orbitkv.NotificationError) as exc:
        a.send_notification("127.0.0.1:1", "x", b"y")
    assert exc.value.peer == "127.0.0.1:1"


def test_notification_to_malformed_endpoint(pair):
    a, _ = pair
    with pytest.raises(orbitkv.BadEndpointError):
        a.send_notification("no-port", "x", b"y")
