"""Byte budgets per connection, enforced below ZeroMQ: a client cannot make a server buffer more
than its share, whether it sends without end or never reads what it asked for.

Why not ZeroMQ's own limits: ZMQ_MAXMSGSIZE bounds one frame, not a message (a peer may send
frames without end, and libzmq holds a multipart message whole before the application sees any
of it), and ZMQ_RCVHWM counts whole messages. Worse, a high-water mark that stops reading a peer
is the state in which libzmq 4.3.5 aborts the process when that peer then hangs up (heartbeat
timer or PONG on a dead engine: `Assertion failed: !_io_error (stream_engine_base.cpp:310)`,
libzmq issue 4841). So the servers' ROUTERs never stop reading (RCVHWM 0), and this guard bounds
what they hold instead:

* in flight towards the server: bytes the kernel handed to libzmq on a connection
  (`tcpi_bytes_received`), less what the server has taken off the socket (`consumed`);
* queued towards the client: bytes of replies the server handed to libzmq (`sent`), less what
  the client's kernel acknowledged (`tcpi_bytes_acked`).

A connection over its budget, or the largest one when all together are over theirs, is cut with
shutdown(2) on its socket: libzmq sees the connection end, frees what it held, and the writer
drops the client's session (its open segments are aborted), as for any client that went away.

The guard is a thread. It learns of connections from the socket monitor (the accepted socket's
descriptor comes with the event), reads TCP_INFO every `interval` and, as it owns the monitor,
also reports refused handshakes and disconnections. Only TCP connections are guarded: ipc:// is
local (and its socket's directory is the owner's only). Linux only; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from h5replay.server.auth import RefusalLog

__all__ = ["ConnectionGuard", "Budgets", "FRAME_OVERHEAD", "MONITOR_EVENTS"]

log = logging.getLogger("h5replay.server")

#: Bytes a frame costs on the wire besides its payload, at most (ZMTP flags and size: 9; CURVE's
#: MESSAGE command: about 42 more). Consumption is counted with this, so estimates err low.
FRAME_OVERHEAD = 64
#: Bytes per second forgiven on every connection (heartbeat PINGs and PONGs, handshakes).
_ALLOWANCE = 4096
_TCP_INFO_BYTES = 232
_BYTES_ACKED, _BYTES_RECEIVED = 120, 128  # offsets of tcpi_bytes_acked / tcpi_bytes_received (Linux >= 4.1)
MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_CLOSED | zmq.EVENT_DISCONNECTED
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass(frozen=True)
class Budgets:
    """What connections may make a server hold, in bytes (see the module docstring)."""

    in_per_client: int
    out_per_client: int
    in_total: int
    out_total: int


@dataclass
class _Connection:
    fd: int
    peer: Any  # its address, read when first seen: a descriptor reused by another connection tells
    unguarded: bool = False  # not TCP (ipc): nothing to read
    received: int = -1  # tcpi_bytes_received when last read (-1: not yet)
    acked: int = -1
    pending_in: int = 0
    queued_out: int = 0
    consumed: int = 0  # counted by the server's loop (bytes taken off the socket, with frame overhead)
    consumed_seen: int = 0
    sent: int = 0  # counted by the server's loop (bytes of replies handed to libzmq)
    sent_seen: int = 0


def _tcp_socket(fd: int) -> socket.socket | None:
    """A duplicate of descriptor `fd` as a socket object, or None if it is not a TCP socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        sock.close()
        return None
    return sock


def _counters(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes received, bytes acked by the peer) of a TCP socket, or None."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _BYTES_RECEIVED + 8:
        return None
    (acked,) = struct.unpack_from("=Q", info, _BYTES_ACKED)
    (received,) = struct.unpack_from("=Q", info, _BYTES_RECEIVED)
    return int(received), int(acked)


def _peer(sock: socket.socket) -> Any:
    try:
        return sock.getpeername()
    except OSError:
        return None


class ConnectionGuard:
    """Watches the connections of one or more server sockets and cuts those over budget.

    The server's loop calls `consumed` for each message it takes off a socket and `sent` for each
    reply it sends, naming the connection by the "__fd" of the message (`fd_of`). Everything
    else runs in the guard's thread. `refused(event, value, endpoint)` is called for handshakes
    that failed before a key was checked (the monitor's event, its value and endpoint);
    `disconnects` is set when a peer went away.
    """

    def __init__(self, budgets: Budgets, *, name: str, interval: float = 0.02,
                 refused: Callable[[int, int, str], None] | None = None) -> None:
        self.budgets = budgets
        self.name = name
        self.interval = interval
        self.disconnects = threading.Event()
        self.cuts = 0
        self._refused = refused
        self._connections: dict[int, _Connection] = {}
        self._monitors: list[zmq.Socket[Any]] = []
        self._new_monitors: list[zmq.Socket[Any]] = []
        self._lock = threading.Lock()  # guards _new_monitors only; counters are plain ints under the GIL
        self._stop = threading.Event()
        self._log = RefusalLog()
        self._thread: threading.Thread | None = None
        self._last_failure_log = -math.inf
        self.enabled = sys.platform.startswith("linux")

    # ------------------------------------------------------------------ called by the server

    def watch(self, monitor: zmq.Socket[Any]) -> None:
        """Hand over a monitor socket (from `sock.get_monitor_socket(MONITOR_EVENTS)`); from now
        on only the guard's thread uses it."""
        with self._lock:
            self._new_monitors.append(monitor)

    @staticmethod
    def fd_of(frame: Any) -> int:
        """The descriptor of the connection a received frame came from (-1 if unknown)."""
        try:
            return int(frame.get("__fd"))
        except (zmq.ZMQError, TypeError, ValueError, AttributeError):
            return -1

    def consumed(self, fd: int, nbytes: int, frames: int) -> None:
        """The server took a message of `frames` frames and `nbytes` payload bytes off `fd`."""
        conn = self._connections.get(fd)
        if conn is None:
            if fd < 0 or not self.enabled:
                return
            conn = self._connections.setdefault(fd, _Connection(fd, None))
        conn.consumed += nbytes + frames * FRAME_OVERHEAD

    def sent(self, fd: int, nbytes: int) -> None:
        """The server handed `nbytes` of a reply to libzmq for the connection `fd`."""
        conn = self._connections.get(fd)
        if conn is not None:
            conn.sent += nbytes

    def live(self) -> set[int]:
        """The descriptors of the connections open now, as far as the monitor has told."""
        return set(self._connections)  # one C call under the GIL: the guard's thread cannot change it meanwhile

    def disconnect(self, fd: int, why: str) -> None:
        """Close the connection `fd` now (a client whose key was revoked)."""
        conn = self._connections.get(fd)
        if conn is not None and not conn.unguarded and conn.peer is not None:
            self._cut(conn, why)

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"h5replay-guard-{self.name}", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the monitor sockets. Safe twice."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._lock:
            monitors, self._monitors, self._new_monitors = self._monitors + self._new_monitors, [], []
        for monitor in monitors:
            with contextlib.suppress(zmq.ZMQError):
                monitor.close(0)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        poller = zmq.Poller()
        next_check = time.monotonic()
        while not self._stop.is_set():
            with self._lock:
                for monitor in self._new_monitors:
                    poller.register(monitor, zmq.POLLIN)
                self._monitors += self._new_monitors
                self._new_monitors.clear()
            timeout = max(0.0, next_check - time.monotonic())
            try:
                ready = dict(poller.poll(int(timeout * 1000) + 1)) if self._monitors else {}
                if not self._monitors:
                    self._stop.wait(timeout)
                for sock in ready:
                    while sock.poll(0):
                        self._event(parse_monitor_message(sock.recv_multipart()))
                now = time.monotonic()
                if now >= next_check:
                    self._check(self.interval)
                    next_check = now + self.interval
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                self._survive(exc)
            except Exception as exc:  # noqa: BLE001 - the guard (and the refusal log) must outlive one bad event
                self._survive(exc)

    def _survive(self, exc: BaseException) -> None:
        """Log what went wrong in the guard's thread (once a minute at most) and carry on."""
        now = time.monotonic()
        if now - self._last_failure_log > 60:
            self._last_failure_log = now
            log.warning("the %s connection guard met %r; it carries on", self.name, exc, exc_info=exc)
        self._stop.wait(self.interval)

    def _event(self, event: Any) -> None:
        kind, value = event["event"], int(event["value"])
        if kind == zmq.EVENT_ACCEPTED and self.enabled:
            self._connections[value] = _Connection(value, None)
        elif kind in (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED):
            self._connections.pop(value, None)
            self.disconnects.set()
        elif kind in _HANDSHAKE_FAILURES and self._refused is not None:
            endpoint = event["endpoint"]
            self._refused(kind, value, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint))

    def _check(self, elapsed: float) -> None:
        budgets = self.budgets
        forgiven = int(_ALLOWANCE * elapsed)
        over: list[tuple[str, _Connection]] = []
        total_in = total_out = 0
        for fd, conn in list(self._connections.items()):
            if conn.unguarded:
                continue
            sock = _tcp_socket(fd)
            if sock is None:
                conn.unguarded = True  # not TCP (ipc), or gone (its close event is on the way)
                continue
            try:
                if conn.peer is None:
                    conn.peer = _peer(sock)
                counters = _counters(sock)
            finally:
                sock.close()
            if counters is None:
                conn.unguarded = True
                continue
            received, acked = counters
            if received < conn.received or acked < conn.acked:
                # The descriptor now belongs to another connection (counters never go back): afresh.
                conn = self._connections[fd] = _Connection(fd, None, consumed=conn.consumed,
                                                           consumed_seen=conn.consumed, sent=conn.sent,
                                                           sent_seen=conn.sent)
            if conn.received >= 0:
                conn.pending_in += received - conn.received
                conn.queued_out -= acked - conn.acked
            conn.received, conn.acked = received, acked
            consumed, sent = conn.consumed, conn.sent
            conn.pending_in = max(0, conn.pending_in - (consumed - conn.consumed_seen) - forgiven)
            conn.queued_out = max(0, conn.queued_out + (sent - conn.sent_seen))
            conn.consumed_seen, conn.sent_seen = consumed, sent
            total_in += conn.pending_in
            total_out += conn.queued_out
            if conn.pending_in > budgets.in_per_client:
                over.append((f"{conn.pending_in} bytes sent to it are not yet taken, over the budget of "
                             f"{budgets.in_per_client}", conn))
            elif conn.queued_out > budgets.out_per_client:
                over.append((f"{conn.queued_out} bytes of replies wait for it to read them, over the budget of "
                             f"{budgets.out_per_client}", conn))
        if not over and total_in > budgets.in_total:
            conn = max(self._connections.values(), key=lambda c: c.pending_in)
            over.append((f"all clients together have {total_in} bytes in flight, over {budgets.in_total}, and it holds "
                          f"the most ({conn.pending_in})", conn))
        if not over and total_out > budgets.out_total:
            conn = max(self._connections.values(), key=lambda c: c.queued_out)
            over.append((f"replies to all clients together hold {total_out} bytes, over {budgets.out_total}, and it "
                          f"holds the most ({conn.queued_out})", conn))
        for why, conn in over:
            self._cut(conn, why)

    def _cut(self, conn: _Connection, why: str) -> None:
        sock = _tcp_socket(conn.fd)
        if sock is None:
            return
        try:
            if sock.getpeername() != conn.peer:
                return  # the descriptor was reused meanwhile: not the one to cut
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return
        finally:
            sock.close()
        self._connections.pop(conn.fd, None)
        self.cuts += 1
        peer = conn.peer[0] if isinstance(conn.peer, tuple) else str(conn.peer)
        self._log.refused(f"cut {why[:24]}", str(peer), f"{self.name}: disconnected the client at {conn.peer}: {why}")
