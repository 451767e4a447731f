"""Reader processes: serve learners' reads from their own SWMR view of the file.

A single reader binds the learners' endpoint itself. Several sit behind a front process that
binds the learners' endpoint and hands each request to a ready reader (round robin) and each
reply back. Each reader opens the file as an SWMR reader, so reads never hold up the writer's
loop; it sees exactly what the writer published.

Why a front process in Python, not pyzmq's proxy device (`zmq.proxy_steerable` in a thread): the
server must bound what each learner makes it hold (guard.py), which needs to know, message by
message, which connection a request came from and a reply goes to. The C proxy cannot tell it:
libzmq drops a message's metadata (its connection's descriptor) when it forwards or captures
it. The front does that accounting; in its own process it costs the writer nothing.

Behind the front, the readers connect to it (ipc, in the server's private directory) with a
routing id the front can check: the reader's index and generation, signed with a secret only the
server's processes know. The front sends requests to, and takes replies from, signed ids only: a
process of the same user that connects there is ignored, and cannot slip a reply to a learner.

Every process here stamps `beats[index]` (monotonic seconds) every poll; the writer replaces one
that has not stamped for `reader_timeout` (stopped with SIGSTOP, or stuck).

A reader opens the file by its path, which is not always the file the writer holds: another
replay moved over it (`mv backup.h5 FILE`, a restore) is what a reader started afterwards (a
replacement, or a crashed one restarted) would open. So the writer hands its readers the identity
of the file it holds (`FileIdentity`: device, inode, replay_id) and a reader that opened another
file serves none of it: every request gets a StorageError saying so, and the writer logs it. Why
not open the very inode the writer holds (/proc/<writer>/fd/N)? That needs Linux and a readable
/proc, and would quietly go on serving a file that no longer has a name, whose commits a restart
then loses; the path changed under the server, and the operator should hear of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any, NamedTuple

import numpy as np
import zmq

from h5replay import protocol as P
from h5replay.config import ServerConfig
from h5replay.errors import AccessDeniedError, LimitExceededError, ProtocolError, ServerUnavailableError, StorageError
from h5replay.server.auth import RefusalLog, RoleAuthenticator, server_keys
from h5replay.server.guard import MONITOR_EVENTS, Budgets, ConnectionGuard, max_connections
from h5replay.server.reads import read_reply, reply_rows
from h5replay.server.sockets import Started, bound_endpoint, configure_router
from h5replay.storage.replay.buffer import ReplayBuffer

__all__ = ["ReaderPool", "FileIdentity", "front_endpoint", "reader_token"]

log = logging.getLogger("h5replay.server")
_POLL_MS = 100
# Each reader's figures in the shared counters array: requests answered, rows sent, rows drawn
# (of those, by sample / sample_sequences / sample_transitions).
_COUNTERS = 3
_QUEUED_FOR_FRONT = 4  # replies a reader behind the front may have waiting for it
_FRONT_WAIT = 2.0  # seconds a reader waits for the front to take a reply
_READY_EVERY = 1.0  # seconds between a reader's "ready" to the front (a replaced front learns of it)
_READY = b""  # the frame a reader sends to say it is ready


class FileIdentity(NamedTuple):
    """Which file a process holds open: its device and inode (whatever name leads to it now), and
    the replay_id inside it."""

    device: int
    inode: int
    replay_id: str

    @classmethod
    def of(cls, buffer: ReplayBuffer) -> FileIdentity:
        """The identity of the file `buffer` holds open.

        Raises:
            StorageError: the open file cannot be looked at.
        """
        return cls(*buffer.file_storage.file_identity(), buffer.replay_id)

    def describe(self) -> str:
        return f"device {os.major(self.device)}:{os.minor(self.device)} inode {self.inode}, replay_id {self.replay_id}"

    def same_file(self, path: str) -> bool | None:
        """Whether `path` leads to this file now (None: nothing is there)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino) == (self.device, self.inode)


def replaced_file(path: str, held: FileIdentity, opened: FileIdentity) -> str:
    """What a reader that opened `opened` at `path`, instead of the writer's `held`, says."""
    return (f"{path!r} is no longer the file this server holds: it was replaced or moved while the server runs (the "
            f"server holds {held.describe()}; the path now leads to {opened.describe()}), so this reader serves "
            "none of it; restart the server to serve the file now at that path")


def front_endpoint(directory: str) -> str:
    """The ipc endpoint the front binds for its readers, in the server's private directory."""
    return f"ipc://{directory}/front"


def reader_token(secret: bytes, index: int, generation: int) -> bytes:
    """The routing id of reader `index` (its `generation`-th process) behind the front: index,
    generation and their HMAC under the server's secret."""
    head = index.to_bytes(2, "big") + generation.to_bytes(4, "big")
    return head + hmac.new(secret, head, hashlib.sha256).digest()[:16]


def token_is_valid(secret: bytes, token: bytes) -> bool:
    """Whether a routing id is one `reader_token` signed with `secret`."""
    if len(token) != 22:
        return False
    return hmac.compare_digest(hmac.new(secret, token[:6], hashlib.sha256).digest()[:16], token[6:])


def answer(buffer: ReplayBuffer, request: P.Request, rng: np.random.Generator, config: ServerConfig,
           instance_id: str, served: str) -> P.Reply:
    """A reader's reply: reads, and `info` / `heartbeat` from its own view of the file (so that
    everything a learner asks is answered by the same kind of view).

    Raises:
        ProtocolError: a request only the writer serves (the message names the writer endpoint's job).
    """
    if request.READS:
        return read_reply(buffer, request, rng, config.limits)
    if isinstance(request, P.Info):
        return P.InfoReply(request.request_id, {**buffer.info(), "instance_id": instance_id, "role": "reader"})
    if isinstance(request, P.Heartbeat):
        return P.HeartbeatReply(request.request_id)
    raise ProtocolError(_not_a_read(request, config, served))  # e.g. a client given this endpoint, not the server's


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
        self.guard = ConnectionGuard(Budgets(*config.byte_budgets()), name=name,
                                     max_connections=max_connections(config.limits.max_clients))
        self.guard.watch(self.sock.get_monitor_socket(MONITOR_EVENTS))  # before the bind: every connection
        self.guard.start()
        _bind_when_free(self.sock, config.resolved_read_bind)
        #: The learners' endpoint as bound (port 0 becomes a free port).
        self.endpoint = bound_endpoint(self.sock)
        self.sock.linger = 0
        self._max_per_key = config.max_clients_per_key
        self._fds_of_key: dict[str, set[int]] = {}  # a key's connections that sent a message
        self._key_of_fd: dict[int, str] = {}

    def refusal(self, frame: Any, fd: int) -> Exception | None:
        """Why a message may not be served (None: it may; always None without --auth): its key
        is no longer listed (the client is disconnected), or it comes on a new connection of a
        key that already has `max_clients_per_key` connections to this endpoint, as the writer
        bounds one key's sessions (refused with an error reply, as the writer does)."""
        if self.auth is None:
            return None
        unlisted = AccessDeniedError("this client's key is no longer listed in the server's key directories")
        try:
            key = str(frame.get("User-Id"))
        except (zmq.ZMQError, AttributeError):
            return unlisted
        if self.auth.role_of(key) is None:
            self.guard.disconnect(fd, "its key was removed from the key directories")
            return unlisted
        if fd < 0 or self._key_of_fd.get(fd) == key:
            return None
        return self._count_connection(key, fd)

    def _count_connection(self, key: str, fd: int) -> Exception | None:
        """A first message of `key` on connection `fd` (or a descriptor reused by another key)."""
        previous = self._key_of_fd.pop(fd, None)
        if previous is not None:
            self._fds_of_key.get(previous, set()).discard(fd)
        fds = self._fds_of_key.setdefault(key, set())
        fds.intersection_update(self.guard.live())  # connections that ended no longer count
        if len(fds) >= self._max_per_key:
            return LimitExceededError(
                f"this key already has {len(fds)} connections to the learners' endpoint, the limit max_clients_per_key="
                f"{self._max_per_key} (--max-clients-per-key); close some, or give each host a key")
        if len(self._key_of_fd) > 100_000:  # descriptors of connections long gone: start afresh
            self._key_of_fd.clear()
            self._fds_of_key.clear()
            fds = self._fds_of_key.setdefault(key, set())
        fds.add(fd)
        self._key_of_fd[fd] = key
        return None

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
    config: ServerConfig, behind: tuple[str, bytes] | None, ready: Any, stop: Any, counters: Any, index: int,
    instance_id: str = "", beats: Any = None, identity: FileIdentity | None = None,
) -> None:
    """Body of one reader process (spawned). Exits when `stop` is set or its parent dies.

    `behind` None: bind the learners' endpoint itself (with its own authenticator under --auth,
    and a connection guard); else (the front's endpoint, this reader's routing id): connect to
    the front and serve what it hands over. `identity`: the file the writer holds; a reader that
    opened another one at the path answers every request with a StorageError saying so.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the writer coordinates shutdown
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    beat = _watchdog(beats, index)
    beat()
    limits = config.limits
    buffer = ReplayBuffer.load_from(config.path, read_only=True, multiprocessing=True, open_timeout=config.open_timeout)
    wrong_file: StorageError | None = None
    if identity is not None and (opened := FileIdentity.of(buffer)) != identity:
        wrong_file = StorageError(replaced_file(config.path, identity, opened))
        log.error("reader process %d: %s", index, wrong_file)
        buffer.close()  # none of it is served
    ctx = zmq.Context()
    learners: _Learners | None = None
    guard: ConnectionGuard | None = None
    if behind is None:
        learners = _Learners(ctx, config, f"reader {index}")
        sock, guard = learners.sock, learners.guard
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.routing_id = behind[1]
        # Back-pressure towards the front: a few replies may wait for it, then the reader waits
        # (and takes no more requests) rather than piling replies up in its own memory.
        sock.sndhwm = _QUEUED_FOR_FRONT
        sock.connect(behind[0])
    rng = np.random.default_rng()
    # Where learners reach this reader: the endpoint it bound (a free port for port 0), or the
    # front's (the pool hands readers behind it a config naming the front's bound endpoint).
    served = learners.endpoint if learners is not None else config.advertise_read or config.resolved_read_bind
    ready.set((served,) if learners is not None else None)
    next_ready = 0.0
    try:
        while not stop.is_set() and os.getppid() == parent:
            beat()
            if behind is not None and time.monotonic() >= next_ready:
                with contextlib.suppress(zmq.Again):
                    sock.send(_READY, zmq.NOBLOCK)
                next_ready = time.monotonic() + _READY_EVERY
            if not sock.poll(_POLL_MS):
                continue
            routed = sock.recv_multipart(copy=False)
            route, frames = routed[:1], routed[1:]  # the learner's routing id, from its ROUTER or the front's
            fd = -1
            if guard is not None and frames:
                fd = guard.fd_of(frames[0])
                guard.consumed(fd, sum(len(f) for f in frames), len(frames))
            try:
                refusal = learners.refusal(frames[0], fd) if learners is not None and frames else None
                if refusal is not None:
                    raise refusal
                request = P.decode(frames, limits, expect=P.Request)
                if wrong_file is not None:
                    raise wrong_file
                reply = answer(buffer, request, rng, config, instance_id, served)
                rows = reply_rows(reply)
                counters[_COUNTERS * index + 1] += rows
                if reply.DRAWN:
                    counters[_COUNTERS * index + 2] += rows
            except Exception as exc:  # every refusal becomes an error reply; the reader keeps serving
                reply = P.ErrorReply.from_exception(P.peek_request_id(frames, limits), exc)
                if reply.code == P.ErrorCode.INTERNAL.value:
                    log.exception("reader %d failed on a request", index)
            counters[_COUNTERS * index] += 1
            out = P.encode(reply)
            if guard is not None:  # a learner not reading its replies is not answered (the guard cuts it)
                size = sum(len(f) for f in out)
                if not guard.room_for(fd, size):
                    guard.disconnect(fd, f"its unread replies would pass the budget of {guard.budgets.out_per_client} "
                                         "bytes")
                    continue
                with contextlib.suppress(zmq.Again):
                    sock.send_multipart([*route, *out], flags=zmq.NOBLOCK, copy=False)
                    guard.sent(fd, size)
            else:
                _send_to_front(sock, [*route, *out])
    finally:
        if learners is not None:
            learners.close()
        else:
            sock.close(0)
        ctx.term()
        buffer.close()


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


def front_main(config: ServerConfig, behind: tuple[str, bytes], ready: Any, stop: Any, counters: Any, index: int,
               instance_id: str = "", beats: Any = None) -> None:
    """Body of the front process (spawned) before several readers: it binds the learners'
    endpoint and, behind, `behind[0]` where readers signed with the secret `behind[1]` connect;
    hands each request to a ready reader (round robin) and each reply back, and counts both for
    its connection guard. Exits when `stop` is set or its parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    parent = os.getppid()
    beat = _watchdog(beats, index)
    beat()
    endpoint, secret = behind
    ctx = zmq.Context()
    learners = _Learners(ctx, config, "read front")
    front, guard = learners.sock, learners.guard
    back = ctx.socket(zmq.ROUTER)
    back.linger = 0
    back.router_mandatory = 1  # a reader that is gone raises: it leaves the ring
    back.rcvhwm = 0  # replies are taken at once; what waits for learners is bounded by the guard
    _bind_when_free(back, endpoint)
    ring: list[bytes] = []  # ready readers' ids, in turn
    turn = 0
    fds: dict[bytes, int] = {}  # a learner's routing id -> its connection
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    ready.set((learners.endpoint,))

    def hand_over(frames: list[Any]) -> bool:
        nonlocal turn
        for _ in range(len(ring)):
            reader = ring[turn % len(ring)]
            turn += 1
            try:
                back.send_multipart([reader, *frames], flags=zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                continue  # that reader has plenty to do already
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise
                ring.remove(reader)  # gone (replaced): its successor says it is ready under a new id
        return False

    try:
        while not stop.is_set() and os.getppid() == parent:
            beat()
            events = dict(poller.poll(_POLL_MS))
            for _ in range(256 if back in events else 0):
                try:
                    frames = back.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                reader = frames[0].bytes
                if len(frames) < 2 or not token_is_valid(secret, reader):
                    continue  # not one of ours: ignored, never forwarded
                if len(frames) == 2 and len(frames[1]) == 0:  # "ready"
                    if reader not in ring:
                        ring.append(reader)
                    continue
                fd, size = fds.get(frames[1].bytes, -1), sum(len(f) for f in frames[2:])
                if not guard.room_for(fd, size):  # a learner not reading its replies is cut at its budget
                    guard.disconnect(fd, f"its unread replies would pass the budget of {guard.budgets.out_per_client} "
                                         "bytes")
                    continue
                with contextlib.suppress(zmq.Again):  # a learner not reading its replies is not answered
                    front.send_multipart(frames[1:], flags=zmq.NOBLOCK, copy=False)
                    guard.sent(fd, size)
            for _ in range(256 if front in events else 0):
                try:
                    frames = front.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames) < 2:
                    continue
                fd = guard.fd_of(frames[1])
                guard.consumed(fd, sum(len(f) for f in frames[1:]), len(frames) - 1)
                refusal = learners.refusal(frames[1], fd)
                if refusal is None:
                    if len(fds) > 100_000:
                        fds.clear()
                    fds[frames[0].bytes] = fd
                    if not hand_over(frames):
                        refusal = ServerUnavailableError("no reader process is ready (they are starting, or being "
                                                         "replaced); try again in a moment")
                if refusal is not None:
                    reply = P.ErrorReply.from_exception(P.peek_request_id(frames[1:], config.limits), refusal)
                    with contextlib.suppress(zmq.Again):
                        front.send_multipart([frames[0], *P.encode(reply)], flags=zmq.NOBLOCK)
    finally:
        back.close(0)
        learners.close()
        ctx.term()


def _not_a_read(request: P.Request, config: ServerConfig, served: str) -> str:
    """`config.bind` is the writer's endpoint as bound (the writer hands readers its bound form)."""
    return (f"{request.KIND.value} is not a read request: {served} is the learners' read endpoint "
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
    file in SWMR mode. `directory`: the server's private directory (mode 0700), for the front's
    endpoint, to which the readers connect."""

    def __init__(self, config: ServerConfig, directory: str, instance_id: str = "",
                 identity: FileIdentity | None = None) -> None:
        self._ctx = mp.get_context("spawn")
        self._config = config
        self._identity = identity  # the file the writer holds: readers check they opened it
        self._path_seen: bool | None = True  # whether the path led to it when last looked at
        self._unstarted: set[int] = set()  # processes whose restart the system refused (tried again)
        self._trouble = RefusalLog()
        #: The learners' endpoint as bound by the front (or the single reader) once it started:
        #: replacements bind the same port, even when the configured one was 0.
        self.endpoint = config.resolved_read_bind
        self._instance_id = instance_id
        k = config.num_readers
        self._endpoint = front_endpoint(directory)
        self._secret = os.urandom(32)  # signs the readers' routing ids; known to the server's processes only
        self._generations = [0] * (k + (1 if k > 1 else 0))  # the front is last
        self.counters = self._ctx.Array("q", _COUNTERS * len(self._generations), lock=False)
        self.beats = self._ctx.Array("d", len(self._generations), lock=False)
        self._procs: list[Any] = []
        # Each process's (ready, stop) events, kept as long as the process: a replacement does not
        # wait for its start, and an event the parent let go of is gone before the child loads it.
        self._events: list[tuple[Any, Any]] = []
        for index in range(len(self._generations) - 1, -1, -1):  # the front first: readers connect to it
            self._spawn(index)

    def _name(self, index: int) -> str:
        return "the read front" if index == self._config.num_readers else f"reader process {index}"

    def _spawn(self, index: int, wait: bool = True) -> None:
        """Start process `index`; with `wait`, until it is ready (at server start). A replacement
        does not wait: the writer loop must not stall while a new interpreter imports numpy."""
        ready, stop = Started(self._ctx), self._ctx.Event()
        self.beats[index] = time.monotonic()
        self._generations[index] += 1
        k = self._config.num_readers
        front = index == k
        behind: tuple[str, bytes] | None
        if front:
            target: Any = front_main
            behind = (self._endpoint, self._secret)
        else:
            target = reader_main
            behind = None if k == 1 else (self._endpoint, reader_token(self._secret, index, self._generations[index]))
        proc = self._ctx.Process(
            target=target,
            args=(self._config, behind, ready, stop, self.counters, index, self._instance_id, self.beats,
                  *(() if front else (self._identity,))),
            name="h5replay-read-front" if front else f"h5replay-reader-{index}",
            daemon=True,
        )
        proc.start()
        deadline = time.monotonic() + 60
        while wait and not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"{self._name(index)} failed to start (exit code {proc.exitcode})")
        if wait and index == (k if k > 1 else 0):  # the process that binds the learners' endpoint
            (self.endpoint,) = ready.endpoints(timeout=10)
            self._config = self._config.replace(read_bind=self.endpoint)
        while len(self._procs) <= index:
            self._procs.append(None)
            self._events.append((None, None))
        self._procs[index], self._events[index] = proc, (ready, stop)

    def revive(self) -> int:
        """Restart processes that died, and replace those that stopped answering (no beat for
        `reader_timeout` seconds: stopped, or stuck); returns how many were restarted. A restart
        the system refuses (out of descriptors, processes or memory) is tried again at the next
        call, and logged now and then: it fails that reader, never the writer."""
        self._check_path()
        restarted = 0
        now = time.monotonic()
        for index, proc in enumerate(self._procs):
            silent = now - self.beats[index]
            if proc.is_alive() and silent > self._config.reader_timeout:
                log.warning("%s has not looked at its socket for %.0f s (stopped, or stuck); replacing it",
                            self._name(index), silent)
                proc.kill()
                proc.join(1)
            elif not proc.is_alive() and index not in self._unstarted:
                log.warning("%s exited with code %s; restarting it", self._name(index), proc.exitcode)
            if not proc.is_alive():
                try:
                    self._spawn(index, wait=False)
                except OSError as exc:
                    self._unstarted.add(index)
                    self._trouble.refused(f"spawn {exc.errno}", self._name(index), (
                        f"cannot start {self._name(index)} ({exc.strerror or exc}); trying again every second "
                        "(reads that need it fail meanwhile)"))
                    continue
                self._unstarted.discard(index)
                restarted += 1
        return restarted

    def _check_path(self) -> None:
        """Log, once each time it happens, that the path no longer leads to the file the writer
        holds (replaced or moved): readers started from then on refuse to serve."""
        if self._identity is None:
            return
        same = self._identity.same_file(self._config.path)
        if same is not True and same != self._path_seen:
            log.error("%r no longer leads to the file this server holds (%s): it was %s while the server runs; reader "
                      "processes started from now on (after a crash, or to replace a stuck one) %s; restart the server "
                      "to serve the file at that path", self._config.path, self._identity.describe(),
                      "removed" if same is None else "replaced",
                      "cannot open it" if same is None else "refuse to serve the file now there, and learners reading "
                      "from them get a StorageError saying so")
        self._path_seen = same

    def totals(self) -> dict[str, int]:
        values = list(self.counters)
        return {"read_requests": sum(values[0::_COUNTERS]), "rows_out": sum(values[1::_COUNTERS]),
                "rows_sampled": sum(values[2::_COUNTERS])}

    def stop(self, timeout: float = 5.0) -> None:
        for _, stop in self._events:
            if stop is not None:
                stop.set()
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            if proc is None:
                continue
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1)
