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
also reports refused handshakes and disconnections. It reads through libzmq's own descriptor,
never a duplicate: a duplicate needs a free descriptor, and there is none exactly when a flood of
connections has taken them all. Only TCP connections are guarded: ipc:// is local (and its
socket's directory is the owner's only). Linux only; elsewhere it does nothing.

Connections also cost descriptors, which the server needs for itself (its file, the key
reloads, a reader's restart). A connection accepted into the last `RESERVED_DESCRIPTORS` of the
process's limit, or past `max_connections`, is cut as it comes: the new connection fails, never
the server's own work. The server raises its soft descriptor limit to the hard one at start
(`raise_descriptor_limit`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
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
#: Descriptors kept for the server's own use (its file, key reloads, reader restarts, metrics
#: scrapes), a quarter of the limit at most: a connection accepted into them is cut at once.
RESERVED_DESCRIPTORS = 64
_MOST_DESCRIPTORS = 1 << 16  # the soft limit `raise_descriptor_limit` goes up to, at most


def raise_descriptor_limit() -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (at most 65,536), as Go's runtime
    does: the soft 1,024 of many systems is a few hundred idle connections. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _MOST_DESCRIPTORS if hard == resource.RLIM_INFINITY else min(hard, _MOST_DESCRIPTORS)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft


def max_connections(max_clients: int) -> int:
    """The connections a server process accepts at once: four per client slot, at least 1,024.
    More are cut as they come (see `ConnectionGuard`)."""
    return max(1024, 4 * max_clients)


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


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """Descriptor `fd` (libzmq's) as a socket object that holds no descriptor of its own, or None
    when `fd` is not an open socket now. A duplicate would need a free descriptor, and there is
    none exactly when a flood of connections makes the guard matter most. Detached at the end,
    never closed: the descriptor stays libzmq's."""
    try:
        sock: socket.socket | None = socket.socket(fileno=fd)  # reads its family and type; no new descriptor
    except OSError:
        sock = None
    try:
        yield sock
    finally:
        if sock is not None:
            sock.detach()


def _is_tcp(sock: socket.socket) -> bool:
    return sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM


@contextlib.contextmanager
def _pinned(fd: int) -> Iterator[socket.socket | None]:
    """A duplicate of `fd` as a stream socket, so that what is checked and what is cut are the same
    connection even if libzmq closes `fd` meanwhile; without a free descriptor for it, `fd` itself
    (`_borrowed`): a connection over its budget is cut all the same. None: not an open stream socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        with _borrowed(fd) as borrowed:
            yield borrowed if borrowed is not None and borrowed.type == socket.SOCK_STREAM else None
        return
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        yield None
        return
    with sock:
        yield sock if sock.type == socket.SOCK_STREAM else None


def _counters(sock: socket.socket) -> tuple[int, int] | None:
    """(bytes received, bytes acked by the peer) of a TCP socket, or None."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES)
    except OSError:
        return None
    if len(info) < _BYTES_RECEIVED + 8:  # a kernel before Linux 4.1: no byte counters
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
                 refused: Callable[[int, int, str], None] | None = None, max_connections: int | None = None) -> None:
        self.budgets = budgets
        self.max_connections = max_connections
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
        self._descriptors = sys.maxsize  # the soft RLIMIT_NOFILE, read at start

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

    def room_for(self, fd: int, nbytes: int) -> bool:
        """Whether a reply of `nbytes` may be queued for the connection `fd` within its budget of
        unread replies, as last measured (plus what was handed over since). A server asks before
        it sends, so a client that never reads is cut at its budget, not a few replies past it
        (the guard's own check comes every `interval`, while replies may be made faster)."""
        conn = self._connections.get(fd)
        if conn is None or conn.unguarded:
            return True
        queued = conn.queued_out + max(0, conn.sent - conn.sent_seen)
        return queued == 0 or queued + nbytes <= self.budgets.out_per_client

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
        if conn is not None and not conn.unguarded:
            self._cut(conn, why)

    def start(self) -> None:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._descriptors = sys.maxsize if soft == resource.RLIM_INFINITY else soft
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
            conn = self._connections[value] = _Connection(value, None)
            why = self._no_room(value)
            if why is not None:
                with _borrowed(value) as sock:
                    conn.peer = _peer(sock) if sock is not None else None
                self._cut(conn, why)
        elif kind in (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED):
            self._connections.pop(value, None)
            self.disconnects.set()
        elif kind in _HANDSHAKE_FAILURES and self._refused is not None:
            endpoint = event["endpoint"]
            self._refused(kind, value, endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint))

    def _no_room(self, fd: int) -> str | None:
        """Why the connection just accepted on descriptor `fd` may not stay (None: it may). Linux
        gives the lowest free descriptor, so `fd` tells how few are left: past the limit less the
        reserve, the server could no longer open its own files or re-read its keys."""
        reserve = min(RESERVED_DESCRIPTORS, self._descriptors // 4)
        if fd >= self._descriptors - reserve:
            return (f"no descriptor to spare: it came in on descriptor {fd}, and the last {reserve} of the process's "
                    f"{self._descriptors} (ulimit -n) are kept for the server's own files; raise the limit, or find who "
                    "holds so many connections")
        if self.max_connections is not None and len(self._connections) > self.max_connections:
            return (f"too many connections: {len(self._connections)} are open, over the {self.max_connections} this "
                    "server accepts (4 per client slot of max_clients, at least 1024); find who holds so many")
        return None

    def _check(self, elapsed: float) -> None:
        budgets = self.budgets
        forgiven = int(_ALLOWANCE * elapsed)
        over: list[tuple[str, _Connection]] = []
        total_in = total_out = 0
        for fd, conn in list(self._connections.items()):
            if conn.unguarded:
                continue
            with _borrowed(fd) as sock:
                if sock is None:
                    # Closed: its close event is on the way, or was lost (the monitor drops events
                    # when the guard falls behind), and a stale entry must not count as open.
                    self._connections.pop(fd, None)
                    continue
                if not _is_tcp(sock):
                    conn.unguarded = True  # ipc: local, no TCP counters
                    continue
                if conn.peer is None:
                    conn.peer = _peer(sock)
                counters = _counters(sock)
            if counters is None:
                continue  # no TCP_INFO this time: looked at again next time
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

    def _cut(self, conn: _Connection, why: str) -> bool:
        """Shut connection `conn` down (libzmq then closes it); whether it was."""
        with _pinned(conn.fd) as sock:
            if sock is None:
                return False
            try:
                if conn.peer is not None and sock.getpeername() != conn.peer:
                    return False  # the descriptor was reused meanwhile: not the one to cut
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                return False
        self._connections.pop(conn.fd, None)
        self.cuts += 1
        peer = conn.peer[0] if isinstance(conn.peer, tuple) else str(conn.peer)
        self._log.refused(f"cut {why[:24]}", str(peer), f"{self.name}: disconnected the client at {conn.peer}: {why}")
        return True
