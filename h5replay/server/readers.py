"""Reader processes: serve learners' reads from their own SWMR view of the file.

A single reader binds the learners' endpoint itself. Several sit behind a front process that
binds the learners' endpoint and forwards each request to the readers (a DEALER: round robin)
and each reply back. Each reader opens the file as an SWMR reader, so reads never hold up the
writer's loop; it sees exactly what the writer published.

Why a front process in Python, not pyzmq's proxy device (`zmq.proxy_steerable` in a thread): the
server must bound what each learner makes it hold (guard.py), which needs to know, message by
message, which connection a request came from and a reply goes to. The C proxy cannot tell it:
libzmq drops a message's metadata (its connection's descriptor) when it forwards or captures
it. The front does that accounting; in its own process it costs the writer nothing.

Behind the front each reader binds an ipc endpoint of its own in the server's private directory
(mode 0700) and answers on the connection a request came in on (a ROUTER): a process of the same
user that connects to it can ask for rows (as it could read the file), never slip a reply to a
learner.

Every process here stamps `beats[index]` (monotonic seconds) every poll; the writer replaces one
that has not stamped for `reader_timeout` (stopped with SIGSTOP, or stuck).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

import numpy as np
import zmq

from h5replay import protocol as P
from h5replay.config import ServerConfig
from h5replay.errors import ProtocolError
from h5replay.server.auth import RoleAuthenticator, server_keys
from h5replay.server.guard import MONITOR_EVENTS, Budgets, ConnectionGuard
from h5replay.server.handlers import READ_KINDS, read_reply, reply_rows
from h5replay.server.sockets import configure_router
from h5replay.storage.replay_buffer import ReplayBuffer

__all__ = ["ReaderPool", "reader_endpoint"]

log = logging.getLogger("h5replay.server")
_POLL_MS = 100
_QUEUED_FOR_FRONT = 4  # replies a reader behind the front may have waiting for it
_FRONT_WAIT = 2.0  # seconds a reader waits for the front to take a reply


def reader_endpoint(directory: str, index: int) -> str:
    """The ipc endpoint reader `index` binds behind the proxy, in the server's private directory."""
    return f"ipc://{directory}/reader-{index}"


def answer(buffer: ReplayBuffer, request: P.Request, rng: np.random.Generator, config: ServerConfig,
           instance_id: str) -> P.Reply:
    """A reader's reply: reads, and `info` / `heartbeat` from its own view of the file (so that
    everything a learner asks is answered by the same kind of view).

    Raises:
        ProtocolError: a request only the writer serves (the message names the writer endpoint's job).
    """
    if isinstance(request, READ_KINDS):
        return read_reply(buffer, request, rng, config.limits)
    if isinstance(request, P.Info):
        return P.InfoReply(request.request_id, {**buffer.info(), "instance_id": instance_id})
    if isinstance(request, P.Heartbeat):
        return P.HeartbeatReply(request.request_id)
    raise ProtocolError(_not_a_read(request, config))  # e.g. a client given this endpoint instead of the server's


class _Learners:
    """The learners' side of a process that binds the learners' endpoint: the ROUTER, its
    authenticator under --auth, its connection guard."""

    def __init__(self, ctx: zmq.Context[Any], config: ServerConfig, name: str) -> None:
        self.auth: RoleAuthenticator | None = None
        if config.auth_dir:
            self.auth = RoleAuthenticator(ctx, config.auth_dir)
            self.auth.start()
        self.sock = ctx.socket(zmq.ROUTER)
        configure_router(self.sock, config, server_keys(config.auth_dir) if config.auth_dir else None, mandatory=False)
        self.guard = ConnectionGuard(Budgets(*config.byte_budgets()), name=name)
        self.guard.watch(self.sock.get_monitor_socket(MONITOR_EVENTS))  # before the bind: every connection
        self.guard.start()
        _bind_when_free(self.sock, config.resolved_read_bind)
        self.sock.linger = 0
        self._next_reload = time.monotonic() + 1.0

    def reload(self) -> None:
        if self.auth is not None and time.monotonic() >= self._next_reload:
            self.auth.reload()  # it keeps the keys it had when a directory is empty or unreadable
            self._next_reload = time.monotonic() + 1.0

    def close(self) -> None:
        self.guard.stop()
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()


def _watchdog(beats: Any, index: int) -> Any:
    def beat() -> None:
        if beats is not None:
            beats[index] = time.monotonic()

    return beat


def reader_main(
    config: ServerConfig, endpoint: str | None, ready: Any, stop: Any, counters: Any, index: int,
    instance_id: str = "", beats: Any = None,
) -> None:
    """Body of one reader process (spawned). Exits when `stop` is set or its parent dies.

    `endpoint` None: bind the learners' endpoint itself (with its own authenticator under
    --auth, and a connection guard); otherwise bind `endpoint`, the ipc endpoint the front
    forwards to.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the writer coordinates shutdown
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    beat = _watchdog(beats, index)
    beat()
    limits = config.limits
    buffer = ReplayBuffer.load_from(config.path, read_only=True, multiprocessing=True, open_timeout=config.open_timeout)
    ctx = zmq.Context()
    learners: _Learners | None = None
    guard: ConnectionGuard | None = None
    if endpoint is None:
        learners = _Learners(ctx, config, f"reader {index}")
        sock, guard = learners.sock, learners.guard
    else:
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        # Back-pressure towards the front: a few replies may wait for it, then the reader waits
        # (and takes no more requests) rather than piling replies up in its own memory.
        sock.sndhwm = _QUEUED_FOR_FRONT
        sock.router_mandatory = 1
        _bind_when_free(sock, endpoint)
    routing_frames = 1 if endpoint is None else 2  # behind the front: the front's id, then the learner's
    rng = np.random.default_rng()
    ready.set()
    try:
        while not stop.is_set() and os.getppid() == parent:
            beat()
            if learners is not None:
                learners.reload()
            if not sock.poll(_POLL_MS):
                continue
            routed = sock.recv_multipart(copy=False)
            route, frames = routed[:routing_frames], routed[routing_frames:]
            fd = -1
            if guard is not None and frames:
                fd = guard.fd_of(frames[0])
                guard.consumed(fd, sum(len(f) for f in frames), len(frames))
            try:
                request = P.decode(frames, limits, expect=P.Request)
                reply = answer(buffer, request, rng, config, instance_id)
                counters[2 * index + 1] += reply_rows(reply)
            except Exception as exc:  # every refusal becomes an error reply; the reader keeps serving
                reply = P.ErrorReply.from_exception(P.peek_request_id(frames, limits), exc)
                if reply.code == P.ErrorCode.INTERNAL.value:
                    log.exception("reader %d failed on a request", index)
            counters[2 * index] += 1
            out = P.encode(reply)
            if guard is not None:  # a learner not reading its replies is not answered (the guard cuts it)
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart([*route, *out], flags=zmq.NOBLOCK, copy=False)
                    guard.sent(fd, sum(len(f) for f in out))
            else:
                _send_to_front(sock, [*route, *out])
    finally:
        if learners is not None:
            learners.close()
        else:
            sock.close(0)
        ctx.term()
        buffer.close()


def front_main(config: ServerConfig, readers: list[str], ready: Any, stop: Any, counters: Any, index: int,
               instance_id: str = "", beats: Any = None) -> None:
    """Body of the front process (spawned) in front of several readers: it binds the learners'
    endpoint, forwards each request to a reader (round robin) and each reply back, and counts
    both for its connection guard. Exits when `stop` is set or its parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    beat = _watchdog(beats, index)
    beat()
    ctx = zmq.Context()
    learners = _Learners(ctx, config, "read front")
    front, guard = learners.sock, learners.guard
    back = ctx.socket(zmq.DEALER)
    back.linger = 0
    back.sndhwm = back.rcvhwm = 0  # what waits here is bounded by the guard, per learner
    for endpoint in readers:
        back.connect(endpoint)
    fds: dict[bytes, int] = {}  # a learner's routing id -> its connection
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    ready.set()
    try:
        while not stop.is_set() and os.getppid() == parent:
            beat()
            learners.reload()
            events = dict(poller.poll(_POLL_MS))
            for _ in range(256 if front in events else 0):
                try:
                    frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames) < 2:
                    continue
                fd = guard.fd_of(frames[1])
                guard.consumed(fd, sum(len(f) for f in frames[1:]), len(frames) - 1)
                if len(fds) > 100_000:
                    fds.clear()
                fds[frames[0].bytes] = fd
                back.send_multipart(frames, copy=False)
            for _ in range(256 if back in events else 0):
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                with contextlib.suppress(zmq.Again):  # a learner not reading its replies is not answered
                    front.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    guard.sent(fds.get(frames[0].bytes, -1), sum(len(f) for f in frames[1:]))
    finally:
        back.close(0)
        learners.close()
        ctx.term()


def _send_to_front(sock: zmq.Socket[Any], frames: list[Any]) -> None:
    """Send a reply to the front, waiting while the few it may queue are still there (a front
    that does not take them for `_FRONT_WAIT` seconds, or is gone, loses this one)."""
    deadline = time.monotonic() + _FRONT_WAIT
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sock.poll(int(remaining * 1000) + 1, zmq.POLLOUT):
                return
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return  # the front that asked is gone (replaced): nobody waits for this reply
            raise


def _not_a_read(request: P.Request, config: ServerConfig) -> str:
    return (f"{request.KIND.value} is not a read request: {config.resolved_read_bind} is the learners' read endpoint "
            f"(reads, info, heartbeats); connect clients to the server's endpoint ({config.bind}), whose hello tells "
            "learners where to read")


def _bind_when_free(sock: zmq.Socket[Any], endpoint: str, timeout: float = 10.0) -> None:
    """Bind, waiting out a reader of a killed server that still holds the port: it notices its
    parent is gone and exits within a poll interval."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class ReaderPool:
    """K reader processes, and a front process when K > 1; started after the writer holds the
    file in SWMR mode. `directory`: the server's private directory, for the readers' endpoints."""

    def __init__(self, config: ServerConfig, directory: str, instance_id: str = "") -> None:
        self._ctx = mp.get_context("spawn")
        self._config = config
        self._instance_id = instance_id
        k = config.num_readers
        self._endpoints: list[str | None] = [None] if k == 1 else [reader_endpoint(directory, i) for i in range(k)]
        if k > 1:
            self._endpoints.append(None)  # the front, last
        self.counters = self._ctx.Array("q", 2 * len(self._endpoints), lock=False)
        self.beats = self._ctx.Array("d", len(self._endpoints), lock=False)
        self._procs: list[Any] = []
        # Each process's (ready, stop) events, kept as long as the process: a replacement does not
        # wait for its start, and an event the parent let go of is gone before the child loads it.
        self._events: list[tuple[Any, Any]] = []
        for index in range(len(self._endpoints)):
            self._spawn(index)

    def _name(self, index: int) -> str:
        return "the read front" if index == self._config.num_readers else f"reader process {index}"

    def _spawn(self, index: int, wait: bool = True) -> None:
        """Start process `index`; with `wait`, until it is ready (at server start). A replacement
        does not wait: the writer loop must not stall while a new interpreter imports numpy."""
        ready, stop = self._ctx.Event(), self._ctx.Event()
        self.beats[index] = time.monotonic()
        front = index == self._config.num_readers
        target: Any = front_main if front else reader_main
        first: Any = [e for e in self._endpoints if e is not None] if front else self._endpoints[index]
        proc = self._ctx.Process(
            target=target,
            args=(self._config, first, ready, stop, self.counters, index, self._instance_id, self.beats),
            name="h5replay-read-front" if front else f"h5replay-reader-{index}",
            daemon=True,
        )
        proc.start()
        deadline = time.monotonic() + 60
        while wait and not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{self._name(index)} failed to start (exit code {proc.exitcode})")
        if index < len(self._procs):
            self._procs[index], self._events[index] = proc, (ready, stop)
        else:
            self._procs.append(proc)
            self._events.append((ready, stop))

    def revive(self) -> int:
        """Restart processes that died, and replace those that stopped answering (no beat for
        `reader_timeout` seconds: stopped, or stuck); returns how many were restarted."""
        restarted = 0
        now = time.monotonic()
        for index, proc in enumerate(self._procs):
            silent = now - self.beats[index]
            if proc.is_alive() and silent > self._config.reader_timeout:
                log.warning("%s has not looked at its socket for %.0f s (stopped, or stuck); replacing it",
                            self._name(index), silent)
                proc.kill()
                proc.join(1)
            elif not proc.is_alive():
                log.warning("%s exited with code %s; restarting it", self._name(index), proc.exitcode)
            if not proc.is_alive():
                self._spawn(index, wait=False)
                restarted += 1
        return restarted

    def totals(self) -> dict[str, int]:
        values = list(self.counters)
        return {"read_requests": sum(values[0::2]), "rows_out": sum(values[1::2])}

    def stop(self, timeout: float = 5.0) -> None:
        for _, stop in self._events:
            stop.set()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1)
