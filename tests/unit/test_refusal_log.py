"""RefusalLog: refused handshakes are logged once per (what, from where), and a flood is capped."""

from __future__ import annotations

import errno
import logging
import os

import zmq

from h5replay.server.auth import RefusalLog, handshake_failure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "h5replay.server"]


def test_each_refusal_is_logged_once_per_key_and_address_then_again_after_a_while(caplog):
    caplog.set_level(logging.WARNING, "h5replay.server")
    clock = Clock()
    refusals = RefusalLog(clock)
    assert refusals.refused("key-a", "10.0.0.1", "refused a")
    for _ in range(20):  # a client retrying every second
        clock.now += 1
        assert not refusals.refused("key-a", "10.0.0.1", "refused a")
    assert refusals.refused("key-a", "10.0.0.2", "refused a from elsewhere")  # another address
    assert refusals.refused("key-b", "10.0.0.1", "refused b")  # another key
    clock.now += 300
    assert refusals.refused("key-a", "10.0.0.1", "refused a, still")
    assert lines(caplog) == ["refused a", "refused a from elsewhere", "refused b", "refused a, still"]


def test_a_flood_of_distinct_refusals_is_capped_and_counted(caplog):
    caplog.set_level(logging.WARNING, "h5replay.server")
    clock = Clock()
    refusals = RefusalLog(clock)
    logged = [refusals.refused(f"key-{i}", "10.0.0.9", f"refused {i}") for i in range(50)]
    assert sum(logged) == 10  # a minute's worth
    clock.now += 61
    assert refusals.refused("key-new", "10.0.0.9", "refused new")
    assert lines(caplog)[-1] == "refused new (and 40 more refusals not logged, to keep the log readable)"


def test_handshake_failures_say_what_the_client_got_wrong():
    protocol = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    kind, text = handshake_failure(protocol, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH, "tcp://0.0.0.0:5555", "/keys")
    assert kind == "no keys" and "without CURVE keys" in text and "--secret-key" in text
    kind, text = handshake_failure(protocol, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC, "tcp://0.0.0.0:5555", "/keys")
    assert kind == "server key" and "/keys/server.key" in text
    kind, text = handshake_failure(protocol, 0x10000001, "tcp://0.0.0.0:5555", "/keys")
    assert "0x10000001" in text


def test_a_client_hanging_up_mid_handshake_is_told_as_the_likely_missing_keys():
    kind, text = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, errno.EPIPE, "tcp://172.17.0.2:5555", "/keys")
    assert kind == "no keys" and "tcp://172.17.0.2:5555" in text and os.strerror(errno.EPIPE) in text
    assert "without CURVE keys" in text and "--secret-key" in text
    _, text = handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0, "tcp://127.0.0.1:5555", "/keys")
    assert "the connection closed" in text
