"""One DEALER socket to a server: send requests, match replies by id, time out, never hang.

Sockets are made in the process and thread that use them (never inherited across fork). A
connection may pipeline: `send` returns a request id, `wait` blocks for that id's reply. Replies
to other ids (late answers after a timeout, the server's liveness probes with id 0) are dropped.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Any

import zmq

from h5replay import protocol as P
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ConfigError, ProtocolError, ServerUnavailableError

__all__ = ["Connection", "curve_keys", "dealer", "no_answer", "say_hello"]


def curve_keys(secret_key: str | os.PathLike[str] | None, server_key: str | os.PathLike[str] | None) -> dict[str, bytes] | None:
    """CURVE keys for a client from zmq.auth certificate files, or None when both are None.

    Raises:
        ConfigError: only one of the two is given, or a file holds no usable key.
    """
    if secret_key is None and server_key is None:
        return None
    if secret_key is None or server_key is None:
        raise ConfigError("secret_key and server_key go together: give both certificate files, or neither")
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(os.fspath(secret_key))
        server_public, _ = zmq.auth.load_certificate(os.fspath(server_key))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read CURVE certificates: {exc}") from exc
    if not secret:
        raise ConfigError(f"{os.fspath(secret_key)!r} holds no secret key; pass the .key_secret file")
    return {"public_key": public, "secret_key": secret, "server_key": server_public}


def dealer(ctx: Any, endpoint: str, config: ClientConfig, curve: dict[str, bytes] | None) -> Any:
    """A DEALER socket of `ctx` (a zmq or zmq.asyncio context) set up as every client's is, connected
    to `endpoint` (closed again when the endpoint cannot be dialled)."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = config.max_in_flight
    sock.rcvhwm = 0
    sock.heartbeat_ivl = int(config.heartbeat_interval * 1000)
    sock.heartbeat_timeout = int(max(config.timeout, 3 * config.heartbeat_interval) * 1000)
    # Not ZMQ_IMMEDIATE: with it, a connection that drops makes libzmq end the socket's pipe at
    # once, even between two frames of a reply being read, and libzmq 4.3.5 then aborts the
    # process (`Assertion failed: !_more (src/fq.cpp:80)`). Without it, what this client sends
    # while the server is away waits in its socket (bounded by SNDHWM) and leaves on reconnect;
    # replies it no longer waits for are dropped, and commits carry idempotency keys.
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    # Every send gives up after the timeout too (the timed poll before it is not enough: the
    # peer may vanish in between).
    sock.sndtimeo = int(config.timeout * 1000)
    if curve is not None:
        sock.curve_secretkey = curve["secret_key"]
        sock.curve_publickey = curve["public_key"]
        sock.curve_serverkey = curve["server_key"]
    try:
        sock.connect(endpoint)
    except zmq.ZMQError:  # an endpoint no socket can dial (a lying hello's): nothing to keep open
        sock.close(0)
        raise
    return sock


def no_answer(endpoint: str, timeout: float, with_keys: bool) -> str:
    """Why nothing came back, as far as a client can tell (a refused CURVE handshake looks like
    a dead server from here; the server logs each refusal)."""
    if with_keys:
        return (f"no answer from {endpoint} within {timeout} s: the server is down, or it refused this "
                "client's CURVE keys (is the client's public key in the server's actors/ or learners/ folder, and "
                "is server_key the server's own server.key? The server logs each refusal)")
    return (f"no answer from {endpoint} within {timeout} s: the server is down, or it requires CURVE keys "
            "(a server started with --auth: pass secret_key= and server_key=, or --secret-key/--server-key)")


class Connection:
    """A request/reply channel to one endpoint. Guarded by a lock: usable from several threads."""

    def __init__(self, endpoint: str, config: ClientConfig, *, curve: dict[str, bytes] | None = None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.limits: P.Limits | None = None
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        self._replies: dict[int, P.Reply] = {}
        self._outstanding: set[int] = set()
        self._closed = False
        self._with_keys = curve is not None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = dealer(self._ctx, endpoint, config, curve)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"this connection to {self.endpoint} was closed")
        if os.getpid() != self._pid:
            raise ClosedError("a client cannot be used across fork; create it in the child process")

    def send(self, request_factory: Any, timeout: float | None = None) -> int:
        """Send `request_factory(request_id)`; returns the id. Blocks at most `timeout` (the
        client's by default) when the socket's queue is full (flow control) or no server is
        connected, then raises ServerUnavailableError."""
        timeout = self.config.timeout if timeout is None else timeout
        with self._lock:
            self._check()
            request_id = next(self._ids)
            frames = P.encode(request_factory(request_id), self.limits)
            if not self._sock.poll(int(timeout * 1000), zmq.POLLOUT):
                raise ServerUnavailableError(self._no_answer(timeout))
            try:
                # Never block here: the connection can vanish between the poll and the send, and
                # a blocking send would then wait for a server that may never come back.
                self._sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
            except zmq.Again as exc:
                raise ServerUnavailableError(self._no_answer(timeout)) from exc
            self._outstanding.add(request_id)
            return request_id

    def wait(self, request_id: int, timeout: float | None = None) -> P.Reply:
        """The reply to `request_id`. Raises the server's error as an exception, or
        ServerUnavailableError when no reply comes within the timeout."""
        reply = self.wait_reply(request_id, timeout)
        if isinstance(reply, P.ErrorReply):
            raise reply.exception()
        return reply

    def wait_reply(self, request_id: int, timeout: float | None = None) -> P.Reply:
        """The reply to `request_id`, a refusal (ErrorReply) too; ServerUnavailableError when
        none comes within the timeout (the client's by default)."""
        timeout = self.config.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            self._check()
            while request_id not in self._replies:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                    if request_id in self._replies:
                        break
                    self._outstanding.discard(request_id)
                    raise ServerUnavailableError(self._no_answer(timeout))
                self._take_reply()  # the poll said one is there
            reply = self._replies.pop(request_id)
            self._outstanding.discard(request_id)
        return reply

    def arrived(self, request_id: int) -> bool:
        """Whether the reply to `request_id` is here, never blocking (`wait` then returns it at once)."""
        with self._lock:
            self._check()
            while request_id not in self._replies and self._sock.poll(0, zmq.POLLIN):
                self._take_reply()
            return request_id in self._replies

    def _take_reply(self) -> None:
        """Read one reply that is waiting in the socket; keep it if someone waits for it (liveness
        probes, id 0, and late answers are dropped)."""
        frames = self._sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        reply = P.decode(frames, self.limits or P.DEFAULT_LIMITS, expect=P.Reply)
        if reply.request_id in self._outstanding:
            self._replies[reply.request_id] = reply

    def _no_answer(self, timeout: float) -> str:
        return no_answer(self.endpoint, timeout, self._with_keys)

    def request(self, request_factory: Any, timeout: float | None = None) -> P.Reply:
        """Send and wait for the reply, `timeout` for each (the client's by default)."""
        with self._lock:
            return self.wait(self.send(request_factory, timeout), timeout)

    def forget(self, request_id: int) -> None:
        """Drop a reply that arrived (or will arrive) for a request the caller gave up on."""
        with self._lock:
            self._replies.pop(request_id, None)
            self._outstanding.discard(request_id)

    def close(self) -> None:
        """Close the socket. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if os.getpid() == self._pid:
                self._sock.close(0)


def say_hello(config: ClientConfig, role: str, curve: dict[str, bytes] | None) -> tuple[Connection, P.HelloReply]:
    """Connect to `config.endpoint` and introduce this client; the connection then knows the
    server's limits. Closes the connection again if the hello fails.

    Raises:
        ServerUnavailableError: no answer within `config.timeout`.
        ProtocolError: the answer is not a hello reply.
    """
    conn = Connection(config.endpoint, config, curve=curve)
    try:
        hello = conn.request(lambda rid: P.Hello(rid, config.name, role))
        if not isinstance(hello, P.HelloReply):
            raise ProtocolError(f"expected a hello reply, got {type(hello).__name__}")
    except BaseException:
        conn.close()
        raise
    conn.limits = hello.limits
    return conn, hello
