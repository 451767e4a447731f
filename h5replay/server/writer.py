"""The writer process: owns the HDF5 file and the actors' socket, runs one single-threaded loop.

Concurrency comes from ownership, not locks: this one loop is the only code that writes the file
(h5py serialises HDF5 calls anyway, so threads would buy nothing). Reads are served elsewhere:
reader processes hold SWMR views of the file (one binds the learners' endpoint; several sit
behind a front process, see readers.py); with no reader process (`--readers 0`) this loop serves
reads too, after the writes of each pass. Two helper threads never touch the file: the
connection guard (guard.py: byte budgets per client, below ZeroMQ) and, under --auth, the
authenticator. Control goes by flag: SIGTERM / SIGINT or `stop()` end the loop, which then
aborts open segments, publishes and closes the file, and stops the readers.

Liveness: the ROUTER socket runs ZMTP heartbeats, so libzmq drops a peer that dies or goes
silent. The loop probes every session now and then (an unsolicited reply with request id 0,
which clients ignore); with ROUTER_MANDATORY a probe to a dropped peer fails at once, and that
client's open segments are aborted.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import math
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
import typing
import uuid
from typing import Any

import zmq

from h5replay import protocol as P
from h5replay.config import ServerConfig
from h5replay.errors import AccessDeniedError, ConfigError
from h5replay.sampling import DEFAULT_TABLE, SamplingConfig
from h5replay.server.auth import RefusalLog, RoleAuthenticator, handshake_failure, server_keys
from h5replay.server.guard import MONITOR_EVENTS, Budgets, ConnectionGuard, max_connections, raise_descriptor_limit
from h5replay.server.handlers import Service
from h5replay.server.metrics import Metrics
from h5replay.server.readers import FileIdentity, ReaderPool
from h5replay.server.sockets import Started, bound_endpoint, configure_router
from h5replay.storage.replay.buffer import ReplayBuffer

__all__ = ["Server", "ServerProcess", "Started"]

log = logging.getLogger("h5replay.server")
_POLL_MS = 50
_BATCH = 256  # messages handled per poll before housekeeping gets a turn
_PROBE = P.HeartbeatReply(0)
_MAX_WAITING_READS = 256  # reads the writer takes off its socket before it has answered them
_READ_SHARE = 0.02  # seconds of a pass the writer spends on reads (--readers 0) after its writes
_WRITE_GRACE_MS = 1  # before a read, the writer waits this long for a write to come first
_READ_MAX_WAIT = 0.1  # a read that waited this long is served even while writes keep coming
_READ_PORT_WAIT = 5.0  # seconds a restart waits for a taken read port (a killed server's reader lets go in < 1 s)


#: Storage options that only shape a new file (an existing one keeps its own layout).
_NEW_FILE_ONLY = ("compression", "compression_level", "compression_slot", "chunks")


def open_buffer(config: ServerConfig) -> ReplayBuffer:
    """Reopen the file, or create it when it does not exist (then space and capacity are needed);
    its segment writers share `config.staging_memory_bytes` of memory.

    Raises:
        ConfigError: the file exists with another space or capacity than the config gives.
    """
    buffer = _open_buffer(config)
    buffer.file_storage.segment_memory_bytes = config.staging_memory_bytes
    return buffer


def _open_buffer(config: ServerConfig) -> ReplayBuffer:
    if os.path.exists(config.path):
        buffer = ReplayBuffer.load_from(
            config.path, read_only=False, multiprocessing=config.multiprocessing, open_timeout=config.open_timeout,
            check_bounds=config.check_bounds,
            **{k: v for k, v in config.storage_kwargs.items() if k not in _NEW_FILE_ONLY},
        )
        differences = []
        asked = config.tables if config.tables is not None else (
            {DEFAULT_TABLE: config.sampling} if config.sampling is not None else None)
        if asked is not None and asked != buffer.tables:
            differences.append(f"tables {_shown(buffer.tables)}, not the {_shown(asked)} asked for")
        if config.space is not None and config.space != buffer.space:
            differences.append(f"space {buffer.space!r}, not the {config.space!r} asked for")
        if config.capacity is not None and config.capacity != buffer.capacity:
            differences.append(f"capacity {buffer.capacity or 'unbounded'}, not the {config.capacity} asked for")
        if config.idempotency_window is not None and config.idempotency_window != buffer.idempotency_window:
            differences.append(f"an idempotency window of {buffer.idempotency_window} episodes, not the "
                               f"{config.idempotency_window} asked for")
        asked_compression = config.storage_kwargs.get("compression")
        held = buffer.file_storage.compressed_leaves
        if isinstance(asked_compression, dict) and asked_compression != held:
            differences.append(f"compressed leaves {held or 'none'}, not the {asked_compression} asked for")
        keys = buffer.transition_keys
        if config.observation_keys is not None and (keys is None or tuple(config.observation_keys) != keys.observation):
            differences.append(f"observation keys {list(keys.observation) if keys else 'none'}, not the "
                               f"{list(config.observation_keys)} asked for")
        if differences:
            buffer.close()
            raise ConfigError(f"{config.path!r} exists with {'; and '.join(differences)}; a space, a capacity and "
                              "sampling settings (and the idempotency window) are only for a new file: leave them out "
                              "to serve this one, or give a new path")
        return buffer
    if config.space is None:
        raise ConfigError(f"{config.path!r} does not exist; creating it needs a space (--space SPACE.json)")
    tables = config.tables if config.tables is not None else {DEFAULT_TABLE: config.sampling or SamplingConfig()}
    window: dict[str, Any] = {} if config.idempotency_window is None else {"idempotency_window": config.idempotency_window}
    return ReplayBuffer.create(
        config.space, config.capacity, config.path, multiprocessing=config.multiprocessing,
        open_timeout=config.open_timeout, tables=tables, check_bounds=config.check_bounds, **window,
        observation_keys=config.observation_keys, **config.storage_kwargs,
    )


def _shown(tables: dict[str, SamplingConfig]) -> str:
    return "{" + ", ".join(f"{name!r}: {table.to_json()}" for name, table in tables.items()) + "}"


class Server:
    """An h5replay service over one file. `run()` blocks until stopped; see `ServerProcess` for a
    background process (tests, notebooks). An endpoint on port 0 is bound to any free port:
    `endpoints` says which, once `run` has set its `ready`."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._curve: tuple[bytes, bytes] | None = server_keys(config.auth_dir) if config.auth_dir else None
        self._metrics: Metrics | None = None
        self._deferred: list[tuple[bytes, P.Reply]] = []  # commit replies waiting for the pass's publish
        self._guard: ConnectionGuard | None = None
        self._fds: dict[bytes, int] = {}  # a client's routing id -> its connection (for the guard)
        # Reads waiting for the writes (--readers 0): (id, frames, request, role, key, since).
        self._last_read = self._last_write = 0.0
        self._reads: collections.deque[tuple[bytes, list[zmq.Frame], Any, str | None, str | None, float]] = \
            collections.deque()
        #: This server process's UUID (hello, info): tells a restarted server from the same one.
        self.instance_id = uuid.uuid4().hex
        # The metrics thread never reads the loop's live structures (a scrape must not iterate
        # what the loop is changing): it asks, and the loop takes the figures between two passes.
        self._figures: dict[str, Any] = {}
        self._figure_requests: queue.SimpleQueue[threading.Event] = queue.SimpleQueue()
        #: (actors' endpoint, learners' read endpoint) as bound, once serving.
        self.endpoints: tuple[str, str] | None = None

    def stop(self) -> None:
        """Ask the loop to finish (thread- and signal-safe)."""
        self._stop.set()

    def run(self, ready: Any = None) -> int:
        """Serve until stopped. Returns the process exit code (0 after a clean shutdown). `ready`
        (an Event, or a Started that is also told the endpoints) is set once the server serves.

        Raises:
            ConfigError: an endpoint cannot be bound (its port is taken, say), or the file exists with
                another space or capacity. A start that fails leaves no new file (nor lock) behind.
        """
        config = self.config
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
            # A file-size limit must fail the write (an error reply), not kill the server.
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        created = [config.path] if not os.path.exists(config.path) else []
        buffer: ReplayBuffer | None = None
        ctx = zmq.Context()
        tmpdir = tempfile.mkdtemp(prefix="h5replay-")
        readers: ReaderPool | None = None
        sock = ctx.socket(zmq.ROUTER)
        auth: RoleAuthenticator | None = None
        broken = serving = False
        refusals = RefusalLog()

        def refused(event: int, value: int, endpoint: str) -> None:  # a handshake failed before any key was looked at
            if auth is not None:
                kind, message = handshake_failure(event, value, endpoint, auth.directory)
                refusals.refused(kind, endpoint, message)

        raise_descriptor_limit()  # before any socket; the reader processes inherit it
        guard = self._guard = ConnectionGuard(Budgets(*config.byte_budgets()), name="writer", refused=refused,
                                              max_connections=max_connections(config.limits.max_clients))
        try:
            if config.auth_dir is not None:  # before the bind: no connection may skip the key check
                auth = RoleAuthenticator(ctx, config.auth_dir)
                auth.start()
            self._configure(sock)
            guard.watch(sock.get_monitor_socket(MONITOR_EVENTS))  # before the bind: it sees every connection
            guard.start()
            # The endpoints before the file: a taken port fails at once, with nothing created.
            _bind(sock, config.bind, "the actors' endpoint, --bind")
            bind = bound_endpoint(sock)
            if config.num_readers and not _any_port(config.resolved_read_bind):  # a restart may find a reader
                # of the killed server still on the port
                _check_free(ctx, config.resolved_read_bind, wait=0.0 if config.path in created else _READ_PORT_WAIT)
            buffer = open_buffer(config)
            bound_config = config.bound_to(bind)  # what readers name when a client comes to the wrong door
            if config.num_readers:  # one binds the learners' endpoint, or a front before several
                readers = ReaderPool(bound_config, tmpdir, instance_id=self.instance_id, identity=FileIdentity.of(buffer))
                read_bound = readers.endpoint
            else:
                read_bound = bind  # the writer serves reads itself, on its own endpoint
            self.endpoints = (bind, read_bound)
            read_endpoint = config.advertise_read if config.num_readers and config.advertise_read else read_bound
            service = Service(
                buffer, config.limits, read_endpoint, fsync=config.fsync,
                priority_publish_interval=config.priority_publish_interval,
                extra_stats=readers.totals if readers else None, instance_id=self.instance_id,
                min_free_bytes=config.resolved_min_free_bytes(),
                max_clients_per_key=config.max_clients_per_key if auth is not None else None,
                actor_slots=config.resolved_actor_slots if auth is not None else 0,
                reads_elsewhere=readers is not None,
            )
            log.info(
                "h5replay serving %s (%d rows, capacity %s) on %s; reads on %s by %d reader process(es)%s",
                config.path, len(buffer), buffer.capacity, bind, read_endpoint, config.num_readers,
                " with CURVE authentication" if auth else
                " (INSECURE: no authentication)" if config.insecure else " (no authentication: loopback only)",
            )
            if config.metrics_port is not None:
                self._figures = service.snapshot()
                self._metrics = Metrics(self._ask_figures, config.metrics_port, config.metrics_address)
                log.info("metrics on http://%s:%d/metrics", config.metrics_address, config.metrics_port)
            if isinstance(ready, Started):
                ready.set(self.endpoints)
            elif ready is not None:
                ready.set()
            serving = True
            self._loop(sock, service, readers, auth)
            aborted = service.abort_everything()
            broken = service.write_failure is not None
            if broken:
                log.error("h5replay stopping after a failed write: the file stays as its last commit published "
                          "it, and is recovered when it is next opened")
            else:
                log.info("h5replay stopping: aborted %d open segment(s), flushing %s", aborted, config.path)
        finally:
            guard.stop()
            sock.close(linger=int(1000))
            if auth is not None:
                auth.stop()
            if self._metrics is not None:
                self._metrics.close()
            if readers is not None:
                readers.stop()
            if buffer is not None and not broken:
                buffer.close()
            ctx.term()
            shutil.rmtree(tmpdir, ignore_errors=True)
            if not serving:  # a failed start: remove the file it made, still empty
                for path in created:
                    with contextlib.suppress(OSError):
                        os.unlink(path)
        if broken:
            # HDF5 retries the failed write whenever the file is flushed or closed, and may crash
            # doing so: leave the file as its last commit published it. When this thread owns the
            # process, end it without letting HDF5's exit handlers near the file.
            if threading.current_thread() is threading.main_thread():
                logging.shutdown()
                os._exit(1)
            return 1
        log.info("h5replay stopped cleanly")
        return 0

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        configure_router(sock, self.config, self._curve, mandatory=True)

    def _loop(self, sock: zmq.Socket[Any], service: Service, readers: ReaderPool | None,
              auth: RoleAuthenticator | None) -> None:
        config = self.config
        guard = typing.cast("ConnectionGuard", self._guard)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        next_probe = next_expire = time.monotonic()
        keys_seen = auth.generation if auth is not None else 0
        while not self._stop.is_set():
            due = service.updates_due_in()  # priority updates published on time while nothing comes
            wait = _POLL_MS if due is None else min(_POLL_MS, math.ceil(due * 1000))
            events = dict(poller.poll(0 if self._reads else wait))
            if sock in events:
                # Writes first: reads (only with --readers 0) wait for the end of the pass, and get
                # a bounded share of it, so that reads cannot starve ingest.
                for _ in range(_BATCH):
                    if len(self._reads) >= _MAX_WAITING_READS:
                        break  # the rest waits in the socket, where the guard counts it
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._serve(sock, service, frames, auth)
                if service.waiting:  # requests the rate limit held back may go now
                    self._release(sock, service)
                self._publish(sock, service)
            elif service.waiting:
                self._release(sock, service)  # timeouts end while nothing arrives
                self._publish(sock, service)
            elif due is not None:
                self._publish(sock, service)  # the priority updates' time is up
            if self._reads:
                self._serve_reads(sock, service)
            now = time.monotonic()
            if auth is not None and auth.generation != keys_seen:
                keys_seen = auth.generation
                self._revoke(service, auth)
            if guard.disconnects.is_set():
                guard.disconnects.clear()
                next_probe = min(next_probe, now + 0.05)  # let libzmq finish dropping the peer first
            if now >= next_probe:
                self._probe(sock, service)
                next_probe = now + config.heartbeat_interval
            if now >= next_expire:
                for identity, aborted in service.expire(config.session_timeout, config.idle_timeout):
                    self._fds.pop(identity, None)
                    if aborted:
                        log.warning("client %s was silent for %.0f s: its %d open segment(s) were aborted",
                                    identity.hex(), config.session_timeout, aborted)
                if readers is not None:
                    readers.revive()
                next_expire = now + 1.0
            if not self._figure_requests.empty():
                self._figures = service.snapshot()
                while not self._figure_requests.empty():
                    self._figure_requests.get_nowait().set()

    def _revoke(self, service: Service, auth: RoleAuthenticator) -> None:
        """Keys changed: close the sessions (and connections) of removed keys, abort the open
        segments of keys moved to learners/."""
        dropped, demoted = service.revoke(auth.role_of)
        guard = typing.cast("ConnectionGuard", self._guard)
        for identity in dropped:
            guard.disconnect(self._fds.pop(identity, -1), "its key was removed from the key directories")
            log.warning("client %s: its key was removed; its session is closed and its open segments aborted",
                        identity.hex())
        for identity in demoted:
            log.warning("client %s: its key was moved to learners; its open segments were aborted", identity.hex())

    def _publish(self, sock: zmq.Socket[Any], service: Service, force: bool = False) -> None:
        """Publish the commits of this pass, then send their replies: a commit is acknowledged only
        once it is in the file and flushed. One publish serves every commit, priority update and
        sample that counted against the rate limit of the pass. Priority updates left for a later
        publish (`priority_publish_interval`) keep their replies, and those queued behind them,
        until it is made."""
        try:
            if not service.publish(force):
                return  # priority updates left for a later publish: their replies (and those after) wait
        except Exception as exc:  # the file refused them: the commits it did not take failed
            deferred, self._deferred = self._deferred, []
            deferred = [
                (identity, P.ErrorReply.from_exception(reply.request_id, exc)
                 if service.needs_publish(reply) and not service.is_durable(reply) else reply)
                for identity, reply in deferred
            ]
        else:
            deferred, self._deferred = self._deferred, []
        for identity, reply in deferred:
            self._send(sock, service, identity, reply)

    def _release(self, sock: zmq.Socket[Any], service: Service) -> None:
        """Serve the requests the rate limit let go since (and refuse those whose timeout ended)."""
        for identity, reply in service.released():
            self._reply(sock, service, identity, reply)

    def _reply(self, sock: zmq.Socket[Any], service: Service, identity: bytes, reply: P.Reply) -> None:
        # Replies that need the pass's publish wait for it; a client's later replies queue behind
        # them, so every client still gets its replies in the order it asked.
        if service.needs_publish(reply) or any(i == identity for i, _ in self._deferred):
            self._deferred.append((identity, reply))
        else:
            self._send(sock, service, identity, reply)

    def _serve(self, sock: zmq.Socket[Any], service: Service, frames: list[zmq.Frame],
               auth: RoleAuthenticator | None = None) -> None:
        identity = frames[0].bytes
        body = frames[1:]
        if body and self._guard is not None:
            fd = self._guard.fd_of(body[0])
            self._guard.consumed(fd, sum(len(f) for f in body), len(body))
            if len(self._fds) > 4 * service.limits.max_clients and identity not in self._fds:
                self._fds.clear()  # ids of clients long gone: forget them all at once
            self._fds[identity] = fd
        started = time.perf_counter()
        kind = "invalid"
        try:
            request = P.decode(body, service.limits, expect=P.Request)
            kind = request.KIND.value
            key = self._key(body)
            role = auth.role_of(key) if auth is not None else None
            if auth is not None and role is None:  # listed at its handshake, removed since
                self._guard_disconnect(identity, "its key was removed from the key directories")
                raise AccessDeniedError("this client's key is no longer listed in the server's key directories")
            if request.READS and not service.reads_elsewhere:
                self._reads.append((identity, body, request, role, key, time.monotonic()))  # after the writes
                return
            if request.WRITES:
                self._last_write = time.monotonic()
            if (service.unpublished or service.updates_pending) and request.READS:
                # A read must not see a commit before it is acknowledged, and must see every
                # priority update acknowledged (its client may ask for the publish named in the reply).
                self._publish(sock, service, force=True)
            answer = service.submit(identity, request, role, key)
        except Exception as exc:  # the boundary: every refusal becomes an error reply
            answer = self._refusal(service, body, exc)
        self._answer(sock, service, identity, answer)
        if self._metrics is not None:
            self._metrics.observe(kind, time.perf_counter() - started)

    def _answer(self, sock: zmq.Socket[Any], service: Service, identity: bytes, answer: P.Reply | None) -> None:
        if answer is None:
            return  # it waits for the rate limit (see _release)
        self._reply(sock, service, identity, answer)
        if service.waiting and (answer.ACKNOWLEDGES or answer.DRAWN):
            self._release(sock, service)  # the counters moved: a waiting request may go now

    def _serve_reads(self, sock: zmq.Socket[Any], service: Service) -> None:
        """Answer waiting reads (the writer serves reads only with --readers 0), in the gaps
        between writes: before each read the writer waits a moment (`_WRITE_GRACE_MS`, while writes
        come) for a write, and goes back to its socket if one comes. When no read was served for
        `_READ_MAX_WAIT`, one is served anyway, so that reads are slowed, never starved; and reads
        take at most `_READ_SHARE` seconds of a pass."""
        deadline = time.perf_counter() + _READ_SHARE
        while self._reads and time.perf_counter() < deadline:
            identity, body, request, role, key, since = self._reads[0]
            now = time.monotonic()
            # The grace only while writes come (an actor's next write follows its reply closely);
            # a server that only serves reads serves them without a wait.
            grace = _WRITE_GRACE_MS if now - self._last_write < _READ_MAX_WAIT else 0
            if now - max(since, self._last_read) < _READ_MAX_WAIT and sock.poll(grace):
                return  # writes first
            self._reads.popleft()
            self._last_read = time.monotonic()
            started = time.perf_counter()
            if service.unpublished or service.updates_pending:
                self._publish(sock, service, force=True)  # as in _serve
            answer: P.Reply | None
            try:
                answer = service.submit(identity, request, role, key)
            except Exception as exc:
                answer = self._refusal(service, body, exc)
            self._answer(sock, service, identity, answer)
            if self._metrics is not None:
                self._metrics.observe(request.KIND.value, time.perf_counter() - started)

    @staticmethod
    def _refusal(service: Service, body: list[zmq.Frame], exc: Exception) -> P.ErrorReply:
        service.stats.errors += 1
        reply = P.ErrorReply.from_exception(P.peek_request_id(body, service.limits), exc)
        if reply.code == P.ErrorCode.INTERNAL.value:
            log.exception("internal error while serving a request")
        return reply

    def _guard_disconnect(self, identity: bytes, why: str) -> None:
        if self._guard is not None:
            self._guard.disconnect(self._fds.get(identity, -1), why)

    def _ask_figures(self) -> dict[str, Any]:
        """The service's figures, taken by the loop between two passes (called by the metrics
        thread; waits at most a second, then answers with the last ones taken)."""
        taken = threading.Event()
        self._figure_requests.put(taken)
        taken.wait(1.0)
        return self._figures

    def _key(self, body: list[zmq.Frame]) -> str | None:
        """The CURVE key the message came with (its ZAP User-Id), or None without --auth."""
        if self._curve is None or not body:
            return None
        return str(body[0].get("User-Id"))

    def _send(self, sock: zmq.Socket[Any], service: Service, identity: bytes, reply: P.Reply) -> bool:
        frames = P.encode(reply)
        guard, fd, size = self._guard, self._fds.get(identity, -1), sum(len(f) for f in frames)
        if guard is not None and not guard.room_for(fd, size):  # a client that never reads: cut at its budget
            guard.disconnect(fd, f"its unread replies would pass the budget of {guard.budgets.out_per_client} bytes")
            return True
        try:
            sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
            if guard is not None:
                guard.sent(fd, size)
        except zmq.Again:
            return True  # the client is not reading; it stays known, the reply is lost to it
        except zmq.ZMQError as exc:
            if exc.errno != errno.EHOSTUNREACH:
                raise
            aborted = service.drop_session(identity)
            self._fds.pop(identity, None)
            if aborted:
                log.warning("client %s went away: aborted %d open segment(s)", identity.hex(), aborted)
            return False
        return True

    def _probe(self, sock: zmq.Socket[Any], service: Service) -> None:
        for identity in list(service.sessions):
            self._send(sock, service, identity, _PROBE)


def _bind(sock: zmq.Socket[Any], endpoint: str, flag: str) -> None:
    """Bind, or raise ConfigError in one line saying why (a ZMQError names no endpoint)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EADDRINUSE:
            raise ConfigError(f"cannot bind {endpoint} ({flag}): the address is already in use, by another server "
                              "perhaps; stop it or choose another port") from exc
        raise ConfigError(f"cannot bind {endpoint} ({flag}): {exc.strerror}") from exc


def _any_port(endpoint: str) -> bool:
    """True for a tcp endpoint on port 0 (bound to whatever port is free)."""
    return endpoint.startswith("tcp://") and endpoint.rpartition(":")[2] == "0"


def _check_free(ctx: zmq.Context[Any], endpoint: str, wait: float) -> None:
    """Raise ConfigError unless the learners' endpoint can be bound (its reader binds it later),
    waiting up to `wait` seconds for a taken port: a reader of a server killed a moment ago holds
    it until it notices its parent is gone, within a second."""
    deadline = time.monotonic() + wait
    while True:
        probe = ctx.socket(zmq.ROUTER)
        probe.linger = 0
        try:
            _bind(probe, endpoint, "the learners' endpoint, --read-bind")
            return
        except ConfigError as exc:
            cause = exc.__cause__
            if not isinstance(cause, zmq.ZMQError) or cause.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
        finally:
            probe.close(0)
        time.sleep(0.1)


def _serve_in_child(config: ServerConfig, ready: Any, log_level: int) -> None:
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    raise SystemExit(Server(config).run(ready))


class ServerProcess:
    """A server in a background (spawned) process: started ready, stopped by SIGTERM.

    `child_main(config, ready, log_level, *child_args)` runs in the child; a subclass may name
    another (a module-level function, so the spawned child can import it).
    """

    child_main = staticmethod(_serve_in_child)

    def __init__(
        self, config: ServerConfig, timeout: float = 60.0, log_level: int = logging.WARNING, child_args: tuple[Any, ...] = ()
    ) -> None:
        self.config = config
        ctx = mp.get_context("spawn")
        ready = Started(ctx)
        self.process = ctx.Process(
            target=type(self).child_main, args=(config, ready, log_level, *child_args), name="h5replay-server"
        )
        self.process.start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if not self.process.is_alive() or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"the server process did not start (exit code {self.process.exitcode})")
        try:
            self.endpoints = ready.endpoints(timeout=max(1.0, deadline - time.monotonic()))
        except queue.Empty:  # a child_main that sets `ready` without the endpoints: as configured
            self.endpoints = (config.bind, config.resolved_read_bind)

    @property
    def endpoint(self) -> str:
        """The actors' (and learners' hello) endpoint, as bound (a port 0 became a free port)."""
        return self.endpoints[0]

    @property
    def read_endpoint(self) -> str:
        """The learners' read endpoint, as bound."""
        return self.endpoints[1]

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then wait; returns the exit code (killing it if it does not exit in time)."""
        if self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            self.process.join(timeout)
        if self.process.is_alive():
            self.kill()
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the server (its readers exit when they notice their parent is gone)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
