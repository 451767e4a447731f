"""The connection guard's count of connections (issue 21, defect 11): past `max_connections` a new
connection is cut as it comes, and a connection whose close event the monitor dropped (it drops
events when the guard falls behind) stops counting, so that lost events never lock every new
client out. Real sockets on 127.0.0.1, in process.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator

import pytest
import zmq

from h5replay.server.guard import MONITOR_EVENTS, Budgets, ConnectionGuard

BIG = 1 << 30


@contextlib.contextmanager
def guarded_router(max_connections: int) -> Iterator[tuple[ConnectionGuard, int]]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    guard = ConnectionGuard(Budgets(BIG, BIG, BIG, BIG), name="test", max_connections=max_connections)
    guard.watch(router.get_monitor_socket(MONITOR_EVENTS))
    guard.start()
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield guard, port
    finally:
        guard.stop()
        router.close(0)
        ctx.term()


def closed_by_the_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    sock.settimeout(timeout)
    try:
        while True:
            if not sock.recv(4096):  # libzmq's greeting first, then the end
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.timeout(30)
def test_a_connection_past_the_cap_is_cut_as_it_comes():
    with guarded_router(max_connections=3) as (guard, port):
        held = []
        try:
            for _ in range(3):
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            deadline = time.monotonic() + 5
            while len(guard.live()) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            extra = socket.create_connection(("127.0.0.1", port), timeout=5)
            held.append(extra)
            assert closed_by_the_server(extra), "the connection past the cap was not cut"
            deadline = time.monotonic() + 5  # the guard's thread counts the cut just after it shut the socket
            while guard.cuts < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert guard.cuts == 1
            assert not any(closed_by_the_server(sock, timeout=0.2) for sock in held[:3])
        finally:
            for sock in held:
                sock.close()


@pytest.mark.timeout(30)
def test_a_connection_whose_close_event_was_lost_stops_counting():
    guard = ConnectionGuard(Budgets(BIG, BIG, BIG, BIG), name="test", max_connections=1)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        accepted, _ = listener.accept()
        guard._event({"event": zmq.EVENT_ACCEPTED, "value": accepted.fileno(), "endpoint": b"tcp://127.0.0.1:1"})
        assert guard.live() == {accepted.fileno()}
        accepted.close()  # closed, and no close event comes
        guard._check(0.02)
        assert guard.live() == set()
        client.close()


def test_a_reply_that_would_pass_the_budget_of_unread_replies_finds_no_room():
    """The server asks before it sends: a client that never reads is cut at its budget, not a
    few replies past it (the guard's own check comes only every `interval`)."""
    from h5replay.server.guard import _Connection

    guard = ConnectionGuard(Budgets(BIG, 100, BIG, BIG), name="test")
    guard._connections[7] = _Connection(7, ("127.0.0.1", 1))
    assert guard.room_for(7, 250), "a first reply always fits (a reply bigger than the budget is a budget mistake)"
    guard.sent(7, 60)  # handed over since the guard last measured
    assert guard.room_for(7, 40) and not guard.room_for(7, 41)
    guard._connections[7].queued_out, guard._connections[7].sent_seen = 60, 60  # the guard measured it unread
    assert not guard.room_for(7, 41)
    guard._connections[7].queued_out = 0  # read meanwhile
    assert guard.room_for(7, 100)
    assert guard.room_for(-1, 10**9) and guard.room_for(8, 10**9)  # unknown connections: the guard cuts them itself
