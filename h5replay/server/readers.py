"""Reader processes: serve learners' reads from their own SWMR view of the file.

A single reader binds the learners' endpoint itself. Several sit behind a ZeroMQ proxy thread in
the writer process (ROUTER in front, DEALER behind, no Python in the path), which spreads the
requests over them. Each reader opens the file as an SWMR reader, so reads never hold up the
writer's loop; it sees exactly what the writer published.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import zmq

from h5replay import protocol as P
from h5replay.config import ServerConfig
from h5replay.errors import ProtocolError
from h5replay.server.auth import RoleAuthenticator, server_keys
from h5replay.server.handlers import READ_KINDS, read_reply, reply_rows
from h5replay.server.sockets import configure_router
from h5replay.storage.replay_buffer import ReplayBuffer

__all__ = ["ReaderPool", "ReadProxy"]

log = logging.getLogger("h5replay.server")
_POLL_MS = 100


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


def reader_main(
    config: ServerConfig, endpoint: str, direct: bool, ready: Any, stop: Any, counters: Any, index: int,
    instance_id: str = "",
) -> None:
    """Body of one reader process (spawned). Exits when `stop` is set or its parent dies.

    `direct`: bind the learners' endpoint itself (a ROUTER, with its own authenticator under
    --auth); otherwise connect a DEALER to the writer's proxy at `endpoint`.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the writer coordinates shutdown
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    limits = config.limits
    buffer = ReplayBuffer.load_from(config.path, read_only=True, multiprocessing=True, open_timeout=config.open_timeout)
    ctx = zmq.Context()
    auth: RoleAuthenticator | None = None
    if direct:
        curve = server_keys(config.auth_dir) if config.auth_dir else None
        if config.auth_dir:
            auth = RoleAuthenticator(ctx, config.auth_dir)
            auth.start()
        sock = ctx.socket(zmq.ROUTER)
        configure_router(sock, config, curve, mandatory=False)
        _bind_when_free(sock, endpoint)
    else:
        # DEALER, not REP: learners' DEALERs send no empty delimiter frame, so a REP would drop them.
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
    sock.linger = 0
    rng = np.random.default_rng()
    ready.set()
    next_reload = time.monotonic() + 1.0
    try:
        while not stop.is_set() and os.getppid() == parent:
            if auth is not None and time.monotonic() >= next_reload:
                auth.reload()  # it keeps the keys it had when a directory is empty or unreadable
                next_reload = time.monotonic() + 1.0
            if not sock.poll(_POLL_MS):
                continue
            routed = sock.recv_multipart(copy=False)
            route, frames = routed[:1], routed[1:]  # a ROUTER (ours or the proxy's) put the learner's id first
            try:
                request = P.decode(frames, limits, expect=P.Request)
                reply = answer(buffer, request, rng, config, instance_id)
                counters[2 * index + 1] += reply_rows(reply)
            except Exception as exc:  # every refusal becomes an error reply; the reader keeps serving
                reply = P.ErrorReply.from_exception(P.peek_request_id(frames, limits), exc)
                if reply.code == P.ErrorCode.INTERNAL.value:
                    log.exception("reader %d failed on a request", index)
            counters[2 * index] += 1
            with contextlib.suppress(zmq.Again):  # a learner not reading its replies is not answered
                sock.send_multipart([*route, *P.encode(reply)], flags=zmq.NOBLOCK, copy=False)
    finally:
        sock.close(0)
        if auth is not None:
            auth.stop()
        ctx.term()
        buffer.close()


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


class ReadProxy:
    """A ROUTER (learners) <-> DEALER (readers) proxy running in a thread, in C, without the GIL."""

    def __init__(self, ctx: zmq.Context[Any], front: str, back: str, configure: Any) -> None:
        self._ctx = ctx
        self._control_endpoint = f"inproc://h5replay-proxy-{id(self)}"
        self._control = ctx.socket(zmq.PAIR)
        self._control.linger = 0
        self._control.bind(self._control_endpoint)
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(front, back, configure), daemon=True)
        self._thread.start()
        self._started.wait(10)
        if self._error is not None:
            raise self._error

    def _run(self, front_endpoint: str, back_endpoint: str, configure: Any) -> None:
        front = self._ctx.socket(zmq.ROUTER)
        back = self._ctx.socket(zmq.DEALER)
        control = self._ctx.socket(zmq.PAIR)
        for sock in (front, back, control):
            sock.linger = 0
        try:
            configure(front)
            # A learner that left before its reply came back must not end the proxy: drop the reply.
            front.router_mandatory = 0
            front.bind(front_endpoint)
            back.bind(back_endpoint)
            control.connect(self._control_endpoint)
        except BaseException as exc:
            self._error = exc
            self._started.set()
            for sock in (front, back, control):
                sock.close(0)
            return
        self._started.set()
        try:
            zmq.proxy_steerable(front, back, None, control)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                log.error("the read proxy stopped: %s", exc)
        finally:
            for sock in (front, back, control):
                sock.close(0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._control.send(b"TERMINATE", zmq.NOBLOCK)
            self._thread.join(5)
        self._control.close(0)


class ReaderPool:
    """K reader processes; started after the writer holds the file in SWMR mode."""

    def __init__(self, config: ServerConfig, endpoint: str, direct: bool, instance_id: str = "") -> None:
        self._ctx = mp.get_context("spawn")
        self._config, self._endpoint, self._direct = config, endpoint, direct
        self._instance_id = instance_id
        self.counters = self._ctx.Array("q", 2 * max(1, config.num_readers), lock=False)
        self._procs: list[Any] = []
        # Each reader's (ready, stop) events, kept as long as the reader: a replacement does not
        # wait for its start, and an event the parent let go of is gone before the child loads it.
        self._events: list[tuple[Any, Any]] = []
        for index in range(config.num_readers):
            self._spawn(index)

    def _spawn(self, index: int, wait: bool = True) -> None:
        """Start reader `index`; with `wait`, until it is ready (at server start). A replacement
        does not wait: the writer loop must not stall while a new interpreter imports numpy."""
        ready, stop = self._ctx.Event(), self._ctx.Event()
        proc = self._ctx.Process(
            target=reader_main,
            args=(self._config, self._endpoint, self._direct, ready, stop, self.counters, index, self._instance_id),
            name=f"h5replay-reader-{index}",
            daemon=True,
        )
        proc.start()
        deadline = time.monotonic() + 60
        while wait and not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"reader process {index} failed to start (exit code {proc.exitcode})")
        if index < len(self._procs):
            self._procs[index], self._events[index] = proc, (ready, stop)
        else:
            self._procs.append(proc)
            self._events.append((ready, stop))

    def revive(self) -> int:
        """Restart readers that died; returns how many were restarted."""
        restarted = 0
        for index, proc in enumerate(self._procs):
            if not proc.is_alive():
                log.warning("reader process %d exited with code %s; restarting it", index, proc.exitcode)
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
