"""Helpers for tests that run a real server: ports, server startup, raw sockets, worker bodies.

Imported as a plain module (tests/ has no __init__.py): pytest's `pythonpath` setting puts this
folder on sys.path. Worker functions live here, at module level, because processes start
with the "spawn" method and find their target by module name (a spawned child gets the parent's
sys.path, so `service_helpers` imports there too).

Nothing here may hang: every receive has a timeout, every socket has linger 0, and every process
or server a helper starts is stopped (killed if need be) when its context ends.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import zmq

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import NotEnoughDataError
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

OBS_DIM = 16
# Rows encode who wrote them, so any row read back can be checked on its own.
EPISODE_SPACE = DictSpace({
    "actor": BoxSpace(0, 1000, (), np.int32),
    "episode": BoxSpace(0, 100_000, (), np.int32),
    "step": BoxSpace(0, 1_000_000, (), np.int32),
    "length": BoxSpace(0, 1_000_000, (), np.int32),
    "obs": BoxSpace(-np.inf, np.inf, (OBS_DIM,), np.float32),
})
SPAWN = mp.get_context("spawn")


# ------------------------------------------------------------------------------ ports and servers


_PORTS_PER_WORKER = 1000


def _port_slice() -> range:
    """The ports this test process draws from: below the kernel's ephemeral range, one slice per
    pytest-xdist worker (PYTEST_XDIST_WORKER is gw0, gw1, ...; unset in a plain run)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    number = int(worker) if worker.isdigit() else 0
    slices = max(1, (ephemeral_low - 10_000) // _PORTS_PER_WORKER)
    low = ephemeral_low - _PORTS_PER_WORKER * (1 + number % slices)
    return range(low, low + _PORTS_PER_WORKER)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, for a server that binds it later.

    Not one the kernel picks for port 0: such a port is in the ephemeral range, where any bind to
    port 0 or outgoing connection of the tests running beside this one (pytest-xdist) could take it
    before the server binds it, or while a test restarts its server on it. Ports below that range
    are handed out only on request, and each xdist worker draws from its own slice of them.
    """
    ports = _port_slice()
    for port in random.Random().sample(ports, 100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # a crowded slice: any free port
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def server_config(path: Path | str, space: Any = EPISODE_SPACE, capacity: int | None = 10_000, **changes: Any) -> ServerConfig:
    """A config on loopback port 0 (the server binds free ports and ServerProcess says which:
    `server.endpoint`, `server.read_endpoint`), with liveness settings short enough for tests."""
    settings: dict[str, Any] = {
        "bind": "tcp://127.0.0.1:0",
        "read_bind": "tcp://127.0.0.1:0",
        "heartbeat_interval": 0.2,
        "heartbeat_timeout": 1.0,
        "session_timeout": 30.0,
    }
    settings.update(changes)
    return ServerConfig(path=str(path), space=space, capacity=capacity, **settings)


@contextlib.contextmanager
def running_server(config: ServerConfig) -> Iterator[ServerProcess]:
    """A started server; stopped (killed if it will not stop) when the block ends."""
    server = ServerProcess(config, timeout=60)
    try:
        yield server
    finally:
        if server.process.is_alive():
            server.stop(timeout=10)


class ServerFactory:
    """Starts servers for one test and stops every one of them afterwards."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.servers: list[ServerProcess] = []
        self.stop_timeout = 10.0  # a test that expects a stuck shutdown lowers this

    def __call__(self, name: str = "rb.h5", **changes: Any) -> ServerProcess:
        server = ServerProcess(server_config(self.tmp_path / name, **changes), timeout=60)
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in self.servers:
            if server.process.is_alive():
                server.stop(timeout=self.stop_timeout)


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[ServerFactory]:
    """`start_server(**ServerConfig changes)` -> a running ServerProcess over tmp_path/rb.h5."""
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()


@contextlib.contextmanager
def processes() -> Iterator[list[Any]]:
    """A list to put started processes in; any still alive at the end is killed."""
    procs: list[Any] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


# ---------------------------------------------------------------------------------- raw sockets


class RawClient:
    """A bare DEALER for sending hand-made frames; every receive is bounded by `timeout`."""

    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        self.timeout = timeout
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        self._next_id = 1_000

    def next_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def send(self, frames: list[Any]) -> None:
        if not self.sock.poll(int(self.timeout * 1000), zmq.POLLOUT):
            raise AssertionError(f"could not send within {self.timeout} s")
        self.sock.send_multipart(frames, copy=True)

    def recv(self, timeout: float | None = None) -> P.Reply:
        """The next reply that is not a liveness probe (request id 0)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.sock.poll(int(remaining * 1000) + 1, zmq.POLLIN):
                raise AssertionError("no reply within the timeout")
            reply = P.decode(self.sock.recv_multipart(), expect=P.Reply)
            if reply.request_id != 0:
                return reply

    def request(self, frames: list[Any], timeout: float | None = None) -> P.Reply:
        self.send(frames)
        return self.recv(timeout)

    def call(self, factory: Callable[[int], P.Request]) -> P.Reply:
        """Send a well-formed request built by `factory(request_id)`; return its reply."""
        request_id = self.next_id()
        reply = self.request(P.encode(factory(request_id)))
        assert reply.request_id == request_id
        return reply

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


DROP = object()  # header(..., version=DROP) leaves the key out


def header(kind: Any, request_id: Any = 1, fields: Any = None, arrays: Any = None, **extra: Any) -> bytes:
    """A msgpack header frame, valid or not, as a hand-made message would have."""
    head = {"version": P.PROTOCOL_VERSION, "kind": kind, "id": request_id,
            "fields": {} if fields is None else fields, "arrays": [] if arrays is None else arrays}
    head.update(extra)
    return msgpack.packb({k: v for k, v in head.items() if v is not DROP}, use_bin_type=True)  # type: ignore[no-any-return]


def error_of(reply: P.Reply) -> Exception:
    """The exception a client would raise for `reply` (which must be an error reply)."""
    assert isinstance(reply, P.ErrorReply), f"expected an error reply, got {reply!r}"
    return reply.exception()


# ------------------------------------------------------------------------------- episode content


def obs_for(actor: Any, episode: Any, step: Any) -> np.ndarray:
    """The obs rows of (actor, episode, step) (arrays broadcast): a float32 function of the three."""
    base = (np.asarray(actor, np.float64) * 1_000_000 + np.asarray(episode, np.float64) * 1000
            + np.asarray(step, np.float64))
    return (base[..., None] + np.arange(OBS_DIM)).astype(np.float32)


def episode_rows(actor: int, episode: int, length: int) -> dict[str, np.ndarray]:
    """The rows of one episode, as a batch for EPISODE_SPACE."""
    steps = np.arange(length, dtype=np.int32)
    return {
        "actor": np.full(length, actor, np.int32),
        "episode": np.full(length, episode, np.int32),
        "step": steps,
        "length": np.full(length, length, np.int32),
        "obs": obs_for(actor, episode, steps),
    }


def row_problems(batch: dict[str, np.ndarray]) -> list[str]:
    """What is wrong with rows read back (any leading shape): a row must be self-consistent."""
    a, e, s, n, obs = (np.asarray(batch[k]) for k in ("actor", "episode", "step", "length", "obs"))
    problems = []
    bad_step = (s < 0) | (s >= n)
    if bad_step.any():
        problems.append(f"step outside its episode: steps {s[bad_step][:5]} lengths {n[bad_step][:5]}")
    bad_obs = ~np.all(obs == obs_for(a, e, s), axis=-1)
    if bad_obs.any():
        problems.append(f"obs does not match (actor, episode, step) for {int(bad_obs.sum())} row(s)")
    return problems


def episode_problems(rows: dict[str, np.ndarray], length: int) -> list[str]:
    """What is wrong with the rows of one segment: they must be one whole episode, in order."""
    problems = row_problems(rows)
    actor, episode = int(rows["actor"][0]), int(rows["episode"][0])
    if not (np.all(rows["actor"] == actor) and np.all(rows["episode"] == episode)):
        problems.append(f"segment mixes episodes: {sorted(set(zip(rows['actor'].tolist(), rows['episode'].tolist())))[:5]}")
    if not np.array_equal(rows["step"], np.arange(length)) or not np.all(rows["length"] == length):
        problems.append(f"episode ({actor}, {episode}) is not whole and in order: steps {rows['step'][:10]}..., "
                        f"recorded length {rows['length'][0]}, segment length {length}")
    return problems


def read_file(path: Path | str) -> tuple[list[tuple[int, int]], dict[str, np.ndarray]]:
    """(segments, every row held) of a replay file, reopened read-only."""
    with ReplayBuffer.load_from(path) as rb:
        segments = rb.get_segments()
        rows = rb.get_at(slice(None)) if len(rb) else {}
    return segments, rows


def file_episodes(path: Path | str) -> tuple[list[tuple[int, int]], list[str]]:
    """((actor, episode) of every segment in file order, problems) of a file of EPISODE_SPACE rows.

    Also checks that every row held belongs to a segment: nothing partial sits outside episodes.
    """
    segments, rows = read_file(path)
    found, problems = [], []
    covered = 0
    for start, length in segments:
        if start != covered:
            problems.append(f"rows {covered}..{start} belong to no episode")
        part = {k: v[start:start + length] for k, v in rows.items()}
        problems += episode_problems(part, length)
        found.append((int(part["actor"][0]), int(part["episode"][0])))
        covered = start + length
    total = len(rows["step"]) if rows else 0
    if covered != total:
        problems.append(f"rows {covered}..{total} belong to no episode")
    return found, problems


# --------------------------------------------------------------------------------- worker bodies


def actor_main(endpoint: str, actor: int, num_episodes: int, seed: int, out: Any, partial: Any = None) -> None:
    """Stream `num_episodes` episodes of 1..300 steps, by every client path; report the receipts.

    Puts ("committed", actor, [(episode, length, episode_id, start), ...]) on `out`; about one
    episode in ten is streamed and then aborted on purpose, and is not reported. With a `partial`
    event (the victim), it then flushes `out`, streams 290 rows of one more episode without
    committing it, sets `partial` and waits to be killed.
    """
    rng = np.random.default_rng(seed)
    committed: list[tuple[int, int, int, int]] = []
    victim = partial is not None
    # max_in_flight=1: every append but the last is acknowledged before the next is sent, so the
    # victim's partial rows are in the server's open segment when the test kills it.
    config = ClientConfig(endpoint=endpoint, timeout=30.0, name=f"actor-{actor}",
                          max_in_flight=1 if victim else 4, batch_seconds=0.02)
    with ActorClient(config=config) as client:
        for e in range(num_episodes):
            n = int(rng.integers(1, 301))
            rows = episode_rows(actor, e, n)
            how = int(rng.integers(0, 10))
            if how < 3:
                receipt = client.push_episode(rows)
            elif how < 5:
                with client.segment() as seg:
                    for i in range(n):
                        seg.append({k: v[i] for k, v in rows.items()})
                receipt = seg.receipt
            elif how < 9:
                seg = client.segment()
                cuts = sorted(set(rng.integers(0, n, size=3).tolist()) | {0, n})
                for lo, hi in zip(cuts, cuts[1:]):
                    seg.extend({k: v[lo:hi] for k, v in rows.items()})
                receipt = seg.commit()
            else:  # streamed, then given up: must never be seen
                seg = client.segment()
                seg.extend({k: v[: max(1, n // 2)] for k, v in rows.items()})
                seg.abort()
                continue
            assert receipt is not None and receipt.length == n, (receipt, n)
            committed.append((e, n, receipt.episode_id, receipt.first_row_id))
        out.put(("committed", actor, committed))
        if not victim:
            return
        out.close()
        out.join_thread()  # the receipts are in the pipe before anything can kill this process
        seg = client.segment()
        seg.extend({k: v[:290] for k, v in episode_rows(actor, num_episodes, 300).items()})
        partial.set()
        time.sleep(120)


def learner_main(endpoint: str, seed: int, stop: Any, out: Any) -> None:
    """Sample, sample sequences and read whole segments until `stop`; check every row.

    Puts (problems, (actor, episode) pairs seen, number of reads) on `out`.
    """
    rng = np.random.default_rng(seed)
    problems: list[str] = []
    seen: set[tuple[int, int]] = set()
    reads = 0

    def note(batch: dict[str, np.ndarray]) -> None:
        problems.extend(row_problems(batch))
        seen.update(zip(np.ravel(batch["actor"]).tolist(), np.ravel(batch["episode"]).tolist()))

    with LearnerClient(endpoint, timeout=30.0, name=f"learner-{seed}") as learner:
        while not stop.is_set() or reads < 3:
            time.sleep(0.005)  # leave the two cores to the actors now and then
            try:
                note(learner.sample(64))
            except NotEnoughDataError:
                continue
            try:
                windows = learner.sample_sequences(8, 4)
            except NotEnoughDataError:
                windows = None
            if windows is not None:
                note(windows)
                same = (windows["actor"] == windows["actor"][:, :1]) & (windows["episode"] == windows["episode"][:, :1])
                if not (same.all() and np.all(np.diff(windows["step"], axis=1) == 1)):
                    problems.append("a sampled window crosses an episode boundary or skips steps")
            segments = learner.get_segments()
            for k in rng.integers(0, len(segments), size=min(3, len(segments))):
                start, length = segments[int(k)]
                rows = learner.get(np.arange(start, start + length))
                note(rows)
                problems.extend(episode_problems(rows, length))
            reads += 1
    out.put((problems[:20], sorted(seen), reads))


def sampling_learner_main(endpoint: str, batch_size: int, busy: Any) -> None:
    """Sample back to back; `busy` is set just before each request goes out."""
    with LearnerClient(endpoint, timeout=60.0, name="sampling-learner") as learner:
        learner.sample(1)
        while True:
            busy.set()
            learner.sample(batch_size)


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (from /proc; Linux only)."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX" and b"resource_tracker" not in cmdline:
            children.append(int(entry))
    return children


def pushing_actor_main(endpoint: str, actor: int, stop: Any, out: Any) -> None:
    """Push short episodes back to back until `stop`; put the number pushed on `out`."""
    pushed = 0
    with ActorClient(endpoint, timeout=30.0, name=f"pusher-{actor}") as client:
        while not stop.is_set():
            client.push_episode(episode_rows(actor, pushed, 1 + pushed % 7))
            pushed += 1
    out.put(pushed)


def pipelining_actor_main(endpoint: str, actor: int, out: Any) -> None:
    """Push episodes of 1-7 steps in flight (push_episodes of 5, wait=False) until killed; put
    the receipt of each acknowledged episode on `out` as (episode, episode_id, first_row_id)."""
    pushed = 0
    with ActorClient(endpoint, timeout=30.0, name=f"pipeliner-{actor}") as client:
        while True:
            batch = [episode_rows(actor, pushed + j, 1 + (pushed + j) % 7) for j in range(5)]
            for j, pending in enumerate(client.push_episodes(batch, wait=False)):
                if pending.done():
                    receipt = pending.result()
                    out.put((pushed + j, receipt.episode_id, receipt.first_row_id))
            pushed += 5
