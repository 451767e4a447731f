"""Helpers for the fault, auth and soak tests: spawn targets, retrying workers, checks of a file.

Imported as a plain module, like tests/service_helpers.py (which these build on, read-only): pytest's
`pythonpath` setting puts tests/ on sys.path and spawned children inherit it, so worker functions
defined here at module level can be process targets under the "spawn" start method.

Nothing here may hang: workers stop on an event or a deadline, every client has a timeout, and
every receive is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import resource
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from service_helpers import EPISODE_SPACE, episode_problems, episode_rows, row_problems

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import H5ReplayError, NotEnoughDataError
from h5replay.server import Server, ServerProcess
from h5replay.storage import ReplayBuffer

__all__ = [
    "CrashHistory", "FewDescriptorsServer", "FileState", "Fuzzer", "LimitedServer", "TcpRecorder", "children_of", "cli_command", "cli_server",
    "crash_actor_main", "crash_learner_main", "drain", "few_descriptors_main", "file_holders", "flood_reads", "limited_server_main", "ping", "process_figures", "process_status",
    "read_file_state", "segment_table_problems", "soak_actor_main", "soak_learner_main",
]

# ------------------------------------------------------------------------------- a limited server


def limited_server_main(config: ServerConfig, ready: Any, log_level: int, fsize_bytes: int) -> None:
    """Run a server whose files may not grow past `fsize_bytes` (RLIMIT_FSIZE): a disk that fills up.

    The server ignores SIGXFSZ itself, so a write past the limit fails with EFBIG instead of
    killing the process. Exits with the code `Server.run` returns (1 when it raised).
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
    raise SystemExit(Server(config).run(ready))


class LimitedServer(ServerProcess):
    """`limited_server_main` in a spawned process; started ready, stopped, killed as ServerProcess."""

    child_main = staticmethod(limited_server_main)

    def __init__(self, config: ServerConfig, fsize_bytes: int, timeout: float = 60.0) -> None:
        super().__init__(config, timeout, logging.WARNING, child_args=(fsize_bytes,))


def few_descriptors_main(config: ServerConfig, ready: Any, log_level: int, nofile: int, reserve: int | None,
                         failing_dup: bool, no_pipes_while: str | None) -> None:
    """Run a server that may hold `nofile` descriptors at most (RLIMIT_NOFILE, soft and hard, so
    the server cannot raise it), keeping `reserve` of them for itself (None: the guard's own
    reserve; 0: connections may take every descriptor). With `failing_dup`, os.dup fails with
    EMFILE in the server's process, as it does when descriptors run out; os.pipe does so while
    the file `no_pipes_while` exists (a process cannot be started then)."""
    import errno

    from h5replay.server import guard

    def out_of_descriptors(*_: Any) -> Any:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    if reserve is not None:
        guard.RESERVED_DESCRIPTORS = reserve
    if failing_dup:
        os.dup = out_of_descriptors
    if no_pipes_while is not None:
        pipe, flag = os.pipe, no_pipes_while
        os.pipe = lambda: out_of_descriptors() if os.path.exists(flag) else pipe()
    raise SystemExit(Server(config).run(ready))


class FewDescriptorsServer(ServerProcess):
    """`few_descriptors_main` in a spawned process; started ready, stopped, killed as ServerProcess."""

    child_main = staticmethod(few_descriptors_main)

    def __init__(self, config: ServerConfig, nofile: int = 1024, reserve: int | None = None,
                 failing_dup: bool = False, no_pipes_while: str | None = None, timeout: float = 60.0) -> None:
        super().__init__(config, timeout, logging.WARNING, child_args=(nofile, reserve, failing_dup, no_pipes_while))


def file_holders(parent: int, path: Path | str) -> list[int]:
    """The child processes of `parent` that have `path` open (a server's readers, not its front)."""
    found = []
    for pid in children_of(parent):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(os.fspath(path)):
                        found.append(pid)
                        break
    return found


# ------------------------------------------------------------------------- drain a results queue


def drain(out: Any, into: list[Any], timeout: float = 0.0) -> int:
    """Move every item now on `out` into `into`, waiting up to `timeout` for the first; the count."""
    import queue

    count = 0
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        try:
            item = out.get(timeout=remaining) if count == 0 and remaining > 0 else out.get_nowait()
        except queue.Empty:
            return count
        into.append(item)
        count += 1


# ------------------------------------------------------------------ workers that outlive servers


def _phase_of(where: str, exc: BaseException) -> str:
    return f"{where}:{type(exc).__name__}"


def crash_actor_main(endpoint: str, actor: int, seed: int, max_len: int, stop: Any, out: Any) -> None:
    """Stream episodes to a server that gets killed and restarted; reconnect and carry on.

    Every episode is tried once, under a new (actor, episode) id, and reported on `out`:
      ("start", actor, episode, length, will_abort)   before its first request
      ("ack", actor, episode, length, episode_id, first_row_id)  its commit was acknowledged
      ("lost", actor, episode, phase)                  a request failed (server gone): not retried
      ("aborted", actor, episode)                      given up on purpose after streaming half
      ("wrong", actor, episode, length, receipt)       acknowledged with another length (a bug)
    and finally ("done", actor, acks, lost). After any failure the client is rebuilt: its socket
    may have reconnected to the next server, which knows none of the old segment ids.
    """
    rng = np.random.default_rng(seed)
    config = ClientConfig(endpoint=endpoint, timeout=1.0, name=f"crash-actor-{actor}", max_in_flight=4,
                          batch_rows=64, batch_seconds=0.01, heartbeat_interval=0.2)
    client: ActorClient | None = None
    acks = lost = 0
    episode = 0
    while not stop.is_set():
        if client is None:
            try:
                client = ActorClient(config=config)
            except H5ReplayError:  # not up yet (ServerUnavailableError), or refused while starting
                time.sleep(0.05)
                continue
        n = int(rng.integers(1, max_len + 1))
        how = int(rng.integers(0, 10))
        e, episode = episode, episode + 1
        rows = episode_rows(actor, e, n)
        out.put(("start", actor, e, n, how == 9))
        where = "open"
        try:
            if how < 4:  # one message when short, else a segment the client opens for it
                where = "push"
                receipt = client.push_episode(rows)
            elif how < 9:  # streamed in pieces: several appends in flight, then the commit
                seg = client.segment()
                where = "append"
                cuts = sorted(set(rng.integers(0, n, size=3).tolist()) | {0, n})
                for lo, hi in zip(cuts, cuts[1:]):
                    seg.extend({k: v[lo:hi] for k, v in rows.items()})
                where = "commit"
                receipt = seg.commit()
            else:
                seg = client.segment()
                where = "append"
                seg.extend({k: v[: max(1, n // 2)] for k, v in rows.items()})  # > batch_rows: sent
                where = "abort"
                seg.abort()
                out.put(("aborted", actor, e))
                continue
        except H5ReplayError as exc:
            lost += 1
            out.put(("lost", actor, e, _phase_of(where, exc)))
            client.close()
            client = None
            continue
        if receipt.length != n:  # a bug, not a crash: the test fails on it
            out.put(("wrong", actor, e, n, tuple(receipt)))
            continue
        acks += 1
        out.put(("ack", actor, e, n, int(receipt.episode_id), int(receipt.first_row_id)))
    if client is not None:
        client.close()
    out.put(("done", actor, acks, lost))
    out.close()
    out.join_thread()


def crash_async_actor_main(endpoint: str, actor: int, seed: int, max_len: int, stop: Any, out: Any) -> None:
    """`crash_actor_main` on asyncio: the same episodes and reports, through AsyncActorClient
    (pushes, segments streamed in pieces, aborts), so SIGKILLs meet the asyncio driver too."""
    import asyncio

    from h5replay.client.aio import AsyncActorClient

    async def run() -> tuple[int, int]:
        rng = np.random.default_rng(seed)
        config = ClientConfig(endpoint=endpoint, timeout=1.0, name=f"crash-actor-{actor}", max_in_flight=4,
                              batch_rows=64, batch_seconds=0.01, heartbeat_interval=0.2)
        client: AsyncActorClient | None = None
        acks = lost = episode = 0
        while not stop.is_set():
            if client is None:
                try:
                    client = await AsyncActorClient(config=config).connect()
                except H5ReplayError:
                    await asyncio.sleep(0.05)
                    continue
            n = int(rng.integers(1, max_len + 1))
            how = int(rng.integers(0, 10))
            e, episode = episode, episode + 1
            rows = episode_rows(actor, e, n)
            out.put(("start", actor, e, n, how == 9))
            where = "open"
            try:
                if how < 4:
                    where = "push"
                    receipt = await client.push_episode(rows)
                elif how < 9:
                    seg = client.segment()
                    where = "append"
                    cuts = sorted(set(rng.integers(0, n, size=3).tolist()) | {0, n})
                    for lo, hi in zip(cuts, cuts[1:]):
                        await seg.extend({k: v[lo:hi] for k, v in rows.items()})
                    where = "commit"
                    receipt = await seg.commit()
                else:
                    seg = client.segment()
                    where = "append"
                    await seg.extend({k: v[: max(1, n // 2)] for k, v in rows.items()})
                    where = "abort"
                    await seg.abort()
                    out.put(("aborted", actor, e))
                    continue
            except H5ReplayError as exc:
                lost += 1
                out.put(("lost", actor, e, _phase_of(where, exc)))
                with contextlib.suppress(H5ReplayError):
                    await client.aclose()
                client = None
                continue
            if receipt.length != n:
                out.put(("wrong", actor, e, n, tuple(receipt)))
                continue
            acks += 1
            out.put(("ack", actor, e, n, int(receipt.episode_id), int(receipt.first_row_id)))
        if client is not None:
            with contextlib.suppress(H5ReplayError):
                await client.aclose()
        return acks, lost

    acks, lost = asyncio.run(run())
    out.put(("done", actor, acks, lost))
    out.close()
    out.join_thread()


def crash_learner_main(endpoint: str, seed: int, stop: Any, out: Any) -> None:
    """Sample and read from a server that gets killed and restarted; check every row read.

    A row must be self-consistent (obs matches actor, episode, step), a sampled window must lie in
    one episode, in order, and an episode read by its row ids must come back whole (or not at all,
    once the ring has evicted it). Puts ("learner", seed, problems, reads, failures) on `out`.
    """
    rng = np.random.default_rng(seed)
    config = ClientConfig(endpoint=endpoint, timeout=1.0, name=f"crash-learner-{seed}", heartbeat_interval=0.2)
    problems: list[str] = []
    reads = 0
    failures: dict[str, int] = {}
    learner: LearnerClient | None = None
    while not stop.is_set():
        if learner is None:
            try:
                learner = LearnerClient(config=config)
            except H5ReplayError:
                time.sleep(0.05)
                continue
        try:
            problems.extend(row_problems(learner.sample(32)))
            windows = learner.sample_sequences(4, 3)
            problems.extend(row_problems(windows))
            same = (windows["actor"] == windows["actor"][:, :1]) & (windows["episode"] == windows["episode"][:, :1])
            if not (same.all() and np.all(np.diff(windows["step"], axis=1) == 1)):
                problems.append("a sampled window crosses an episode boundary or skips steps")
            segments = learner.get_segments()
            problems.extend(segment_table_problems(segments, None, None))
            episodes = learner.episodes()
            if episodes:
                episode = episodes[int(rng.integers(0, len(episodes)))]
                rows = learner.get_rows(np.arange(episode.first_row_id, episode.first_row_id + episode.length))
                problems.extend(row_problems(rows))
                problems.extend(episode_problems(rows, episode.length))
            reads += 1
        except (NotEnoughDataError, IndexError):  # EvictedError: the ring moved past the episode
            time.sleep(0.01)
        except H5ReplayError as exc:
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
            learner.close()
            learner = None
        except Exception as exc:  # anything else is a bug: report it rather than vanish
            problems.append(f"unexpected {type(exc).__name__}: {exc}")
            break
    if learner is not None:
        learner.close()
    out.put(("learner", seed, problems[:20], reads, failures))
    out.close()
    out.join_thread()


# ------------------------------------------------------------------------ what a file holds


def segment_table_problems(segments: list[tuple[int, int]], length: int | None, max_len: int | None) -> list[str]:
    """Problems of a (logical start, length) episode table: increasing, disjoint, contiguous, inside
    [0, length) and ending at `length` (when given); a gap only at the head, shorter than `max_len`
    (the rest of an episode the ring has partly overwritten)."""
    problems = []
    for (s0, n0), (s1, n1) in zip(segments, segments[1:]):
        if s1 != s0 + n0:
            problems.append(f"segments ({s0}, {n0}) and ({s1}, {n1}) are not contiguous and increasing")
            break
    if any(n < 1 or s < 0 for s, n in segments):
        problems.append(f"empty or negative segment in {[x for x in segments if x[1] < 1 or x[0] < 0][:3]}")
    if segments and length is not None:
        if segments[-1][0] + segments[-1][1] != length:
            problems.append(f"the last segment {segments[-1]} does not end at the buffer's length {length}")
        if max_len is not None and segments[0][0] >= max_len:
            problems.append(f"{segments[0][0]} rows before the first segment: more than a partly evicted episode")
    return problems


@dataclass
class FileState:
    """A replay file of EPISODE_SPACE rows as a reader sees it, with what is wrong with it."""

    length: int
    capacity: int
    total_rows: int
    total_episodes: int
    segments: list[tuple[int, int]]
    episodes: list[tuple[int, int, int]]  # (actor, episode, length) of each held segment, oldest first
    problems: list[str] = field(default_factory=list)
    first_rows: dict[int, int] = field(default_factory=dict)  # episode id -> its first row id

    @property
    def first_id(self) -> int:
        """Episode id of the first held segment (ids are dense, in commit order)."""
        return self.total_episodes - len(self.episodes)


def read_file_state(path: Path | str, max_len: int) -> FileState:
    """Open `path` as an SWMR reader (works on a file whose writer was killed) and check it:
    every held segment one whole episode in order, no episode twice, the ring and table consistent."""
    with ReplayBuffer.load_from(path, read_only=True, multiprocessing=True) as rb:
        info = rb.info()
        segments = rb.get_segments()
        rows = rb.get_at(slice(None)) if info["length"] else {}
        first_rows = {e.episode_id: e.first_row_id for e in rb.episodes()}
    length, capacity = int(info["length"]), int(info["capacity"])
    state = FileState(length, capacity, int(info["total_rows"]), int(info["total_episodes"]), segments, [],
                      first_rows=first_rows)
    problems = state.problems
    problems += segment_table_problems(segments, length, max_len)
    if int(info["num_episodes"]) != len(segments):
        problems.append(f"num_episodes {info['num_episodes']} but {len(segments)} segments")
    if not 0 <= length <= capacity or state.total_rows < length or state.total_episodes < len(segments):
        problems.append(f"inconsistent ring: {info}")
    if state.total_rows >= capacity and length < capacity - capacity // 64 - max_len:
        problems.append(f"the ring holds {length} rows of {capacity}: more evicted than the protocol allows")
    for start, n in segments:
        part = {k: v[start:start + n] for k, v in rows.items()}
        problems += episode_problems(part, n)
        state.episodes.append((int(part["actor"][0]), int(part["episode"][0]), n))
    seen = [(a, e) for a, e, _ in state.episodes]
    if len(set(seen)) != len(seen):
        problems.append(f"episodes held twice: {sorted({x for x in seen if seen.count(x) > 1})[:5]}")
    return state


class CrashHistory:
    """What the crash workers reported: episodes started, acknowledged, lost, aborted on purpose."""

    def __init__(self) -> None:
        self.started: dict[tuple[int, int], tuple[int, bool]] = {}
        # (actor, episode) -> (length, episode id, first row id)
        self.acks: dict[tuple[int, int], tuple[int, int, int]] = {}
        self.lost: dict[tuple[int, int], str] = {}
        self.done: list[tuple[Any, ...]] = []
        self.learners: list[tuple[Any, ...]] = []
        self.wrong: list[tuple[Any, ...]] = []

    def feed(self, events: list[Any]) -> int:
        """Take reported events in; returns how many were acknowledgements."""
        acks = 0
        for event in events:
            kind = event[0]
            if kind == "start":
                self.started[(event[1], event[2])] = (event[3], event[4])
            elif kind == "ack":
                self.acks[(event[1], event[2])] = (event[3], event[4], event[5])
                acks += 1
            elif kind == "lost":
                self.lost[(event[1], event[2])] = event[3]
            elif kind == "done":
                self.done.append(event)
            elif kind == "learner":
                self.learners.append(event)
            elif kind == "wrong":
                self.wrong.append(event)
        events.clear()
        return acks

    def unknown_held(self, state: FileState) -> list[tuple[int, int, int]]:
        """Held episodes no worker reported starting yet (their report may still be in the pipe)."""
        return [(a, e, n) for a, e, n in state.episodes if (a, e) not in self.started]

    def problems(self, state: FileState, max_len: int) -> list[str]:
        """Held vs. reported: every acknowledged episode present unless evicted by later rows, at its
        acknowledged id; nothing held that was never sent whole or was aborted on purpose."""
        problems = []
        first = state.first_id
        held_ids = {first + i: ep for i, ep in enumerate(state.episodes)}
        for a, e, n in state.episodes:
            started = self.started.get((a, e))
            if started is None:
                problems.append(f"episode ({a}, {e}) is held but was never sent")
            elif started[1]:
                problems.append(f"episode ({a}, {e}) was aborted on purpose but is held")
            elif started[0] != n:
                problems.append(f"episode ({a}, {e}) is held with {n} rows but {started[0]} were sent")
        lengths_by_id = {eid: n for (_, _), (n, eid, _) in self.acks.items()}
        lengths_by_id.update({eid: n for eid, (_, _, n) in held_ids.items()})
        for (a, e), (n, eid, first_row) in sorted(self.acks.items(), key=lambda kv: kv[1][1]):
            if eid >= state.total_episodes:
                problems.append(f"acknowledged episode ({a}, {e}) id {eid} is lost: the file has only "
                                f"{state.total_episodes} episodes")
            elif eid >= first:
                if held_ids[eid] != (a, e, n):
                    problems.append(f"acknowledged episode ({a}, {e}, {n} rows) id {eid} is held as {held_ids[eid]}")
                elif state.first_rows.get(eid) != first_row:
                    problems.append(f"acknowledged episode ({a}, {e}) id {eid} was given row id {first_row} but "
                                    f"is held from row id {state.first_rows.get(eid)}")
            else:
                # Evicted: legitimate only if the rows committed from it on overflow the ring (an upper
                # bound counts every episode never acknowledged as max_len rows).
                rows_from = sum(lengths_by_id.get(i, max_len) for i in range(eid, state.total_episodes))
                if rows_from <= state.capacity - state.capacity // 64 - max_len:
                    problems.append(f"acknowledged episode ({a}, {e}) id {eid} was evicted with at most "
                                    f"{rows_from} rows from it to the end, in a ring of {state.capacity}")
        return problems[:20]


# ------------------------------------------------------------------------------- the CLI server


def cli_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "h5replay", *args]


def ping(bind: str, timeout: float = 1.0) -> bool:
    """`h5replay ping` exits 0."""
    done = subprocess.run(cli_command("ping", bind, "--timeout", str(timeout)), capture_output=True,
                          timeout=30 + timeout)
    return done.returncode == 0


@contextlib.contextmanager
def cli_server(path: Path | str, bind: str, read_bind: str, log_path: Path, *extra: str,
               ready: Any = None, timeout: float = 60.0) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m h5replay serve PATH --bind --read-bind ...` as a subprocess, logging to `log_path`.

    Waits until `ready()` holds (default: `h5replay ping BIND` exits 0); killed at the end if alive.
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cli_command("serve", str(path), "--bind", bind, "--read-bind", read_bind, *extra),
                                stdout=log, stderr=log)
    try:
        check = ready if ready is not None else (lambda: ping(bind))
        deadline = time.monotonic() + timeout
        while not check():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"`h5replay serve` did not come up (exit code {proc.poll()}): "
                                   f"{Path(log_path).read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def flood_reads(endpoint: str, stop: Any) -> None:
    """A learner process that never stops: sample(256) requests pipelined 8 deep on `endpoint`,
    each reply read as it comes, until `stop`."""
    import zmq

    from h5replay import protocol as P

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        sent = got = 0
        while not stop.is_set():
            while sent - got < 8:
                sent += 1
                sock.send_multipart([bytes(f) for f in P.encode(P.Sample(sent, 256))])
            if sock.poll(100):
                sock.recv_multipart()
                got += 1
    finally:
        sock.close(0)


# ------------------------------------------------------------------------------------ fuzzing


def _valid_rows(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """Wire arrays of EPISODE_SPACE (storage dtypes) for `n` rows: valid as far as the space goes."""
    actor = int(rng.integers(900, 1000))  # fuzz rows: actor ids no real actor uses
    return episode_rows(actor, int(rng.integers(0, 1000)), n) if n else {
        k: v[:0] for k, v in episode_rows(actor, 0, 1).items()}


_BAD_DTYPES = ["O", "|O", "<U4", "|V8", "object", "<M8[s]", "", "|S0", "|S1000000000", "S4", "<c16", "f4",
               "int32", "<i4 ", "|b1", ">i4", "<f2", "|S-1", "\x00", "<i16"]
_BAD_VALUES: list[Any] = [None, True, False, -1, 0, 1, 2**63, 2**64, 2**64 - 1, -(2**63), 1.5, float("nan"),
                          float("inf"), "", "x" * 300, b"bytes", [], [1, 2], {}, {"a": 1}, [[[[[]]]]],
                          {"nested": {"deep": [None] * 5}}]


class Fuzzer:
    """Generated and mutated protocol messages, seeded: valid encodings of every kind, then bit flips,
    truncations, dropped / duplicated / swapped frames, headers with fields replaced by junk, absurd
    array declarations, random msgpack and random bytes."""

    def __init__(self, seed: int) -> None:
        import msgpack

        from h5replay import protocol as P

        self.P = P
        self.msgpack = msgpack
        self.rng = random.Random(seed)
        self.np_rng = np.random.default_rng(seed)
        self.next_id = 1
        self._space_json = EPISODE_SPACE.to_json()
        # Valid encodings to mutate, made once: generating is slower than decoding.
        self.requests = [self.frames_of(self.valid_request()) for _ in range(400)]
        self.replies = [self.frames_of(self.valid_reply()) for _ in range(300)]

    # ---------------------------------------------------------------- valid messages

    def request_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def valid_request(self, segment_ids: list[int] | None = None) -> Any:
        P, rng = self.P, self.rng
        rid = self.request_id()
        seg = rng.choice(segment_ids) if segment_ids and rng.random() < 0.7 else rng.randrange(0, 50)
        n = rng.randrange(0, 20)
        kind = rng.randrange(0, 13)
        return [
            lambda: P.Hello(rid, "fuzz", "actor" if rng.random() < 0.8 else "learner"),
            lambda: P.OpenSegment(rid),
            lambda: P.Append(rid, seg, n, _valid_rows(self.np_rng, n)),
            lambda: P.Commit(rid, seg),
            lambda: P.Abort(rid, seg),
            lambda: P.PushEpisode(rid, n, _valid_rows(self.np_rng, n)),
            lambda: P.Get(rid, 0, np.array([rng.randrange(-50, 50) for _ in range(rng.randrange(0, 10))], np.int64)),
            lambda: P.GetRows(rid, 0, np.array([rng.randrange(0, 5000) for _ in range(rng.randrange(0, 10))], np.int64)),
            lambda: P.Sample(rid, rng.randrange(1, 64), None if rng.random() < 0.5 else rng.randrange(0, 2**63)),
            lambda: P.SampleSequences(rid, rng.randrange(1, 8), rng.randrange(1, 8), None, 0, rng.random() < 0.8),
            lambda: P.Episodes(rid),
            lambda: P.Info(rid),
            lambda: P.Heartbeat(rid),
        ][kind]()

    def valid_reply(self) -> Any:
        P, rng = self.P, self.rng
        rid = self.request_id()
        n = rng.randrange(0, 6)
        rows = _valid_rows(self.np_rng, n)
        kind = rng.randrange(0, 14)
        view = (rng.randrange(0, 9), 0, 0, n)
        info = (np.arange(n, dtype=np.int64), np.zeros(n, np.uint64), np.full(n, 0.5))
        return [
            lambda: P.HelloReply(rid, self._space_json, 1000, 5, 1, "0.1.0", 1, P.Limits(), "tcp://127.0.0.1:1", "r", "i"),
            lambda: P.OpenSegmentReply(rid, 3),
            lambda: P.AppendReply(rid, n),
            lambda: P.CommitReply(rid, 7, 0, n),
            lambda: P.AbortReply(rid),
            lambda: P.PushEpisodeReply(rid, 2, 1, n),
            lambda: P.GetReply(rid, *view, np.arange(n, dtype=np.int64), rows),
            lambda: P.GetRowsReply(rid, *view, n, rows),
            lambda: P.SampleReply(rid, *view, *info, rows),
            lambda: P.SampleSequencesReply(rid, *view, *info, {k: np.stack([v, v], axis=1) for k, v in rows.items()}),
            lambda: P.EpisodesReply(rid, *view, np.arange(3 * n, dtype=np.int64).reshape(n, 3)),
            lambda: P.InfoReply(rid, {"length": n, "capacity": None, "uptime": 0.5}),
            lambda: P.HeartbeatReply(rid),
            lambda: P.ErrorReply(rid if rng.random() < 0.8 else None, "bad_request", "no"),
        ][kind]()

    def frames_of(self, msg: Any) -> list[bytes]:
        return [bytes(f) for f in self.P.encode(msg)]

    # ---------------------------------------------------------------- mutations

    def junk(self, depth: int = 0) -> Any:
        rng = self.rng
        r = rng.random()
        if r < 0.6 or depth > 3:
            return _BAD_VALUES[rng.randrange(0, len(_BAD_VALUES))]
        if r < 0.8:
            return [self.junk(depth + 1) for _ in range(rng.randrange(0, 4))]
        return {str(self.junk(depth + 1))[:20]: self.junk(depth + 1) for _ in range(rng.randrange(0, 4))}

    def mutate_header(self, frames: list[bytes]) -> list[bytes]:
        """Unpack the header, replace / drop / add a key or a field or an array entry, pack it again."""
        rng, msgpack = self.rng, self.msgpack
        header = msgpack.unpackb(frames[0], raw=False)
        what = rng.randrange(0, 8)
        keys = list(header)
        if what == 0:
            header[keys[rng.randrange(0, len(keys))]] = self.junk()
        elif what == 1:
            del header[keys[rng.randrange(0, len(keys))]]
        elif what == 2:
            header[str(self.junk())[:10]] = self.junk()
        elif what in (3, 4) and isinstance(header.get("fields"), dict) and header["fields"]:
            fields = header["fields"]
            name = list(fields)[rng.randrange(0, len(fields))]
            fields[name] = self.junk() if what == 3 else (2**64 + 5 if rng.random() < 0.5 else -7)
        elif what in (5, 6) and header.get("arrays"):
            entry = header["arrays"][rng.randrange(0, len(header["arrays"]))]
            if what == 5:  # a dtype the wire must refuse, or a legal one that does not match the bytes
                entry[1] = _BAD_DTYPES[rng.randrange(0, len(_BAD_DTYPES))]
            else:  # a shape that does not match the bytes: huge, negative, too many dims, zero-sized
                entry[2] = [[2**40], [2**62, 2**62], [-1], [0, 2**50, 2**50], [1] * 40, [0],
                            [rng.randrange(0, 100)], "shape", [1.5]][rng.randrange(0, 9)]
        else:
            header["kind"] = ["hello", "append", "commit", "sample", "reply", "nope", "", 7, None][rng.randrange(0, 9)]
        try:
            packed = msgpack.packb(header, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            packed = frames[0]
        return [packed, *frames[1:]]

    def mutate_bytes(self, frames: list[bytes]) -> list[bytes]:
        """Bit flips, truncations, extensions; frame drops, duplicates, swaps, additions."""
        rng = self.rng
        frames = list(frames)
        what = rng.randrange(0, 7)
        i = rng.randrange(0, len(frames))
        if what == 0:  # flip bits, most often in the header
            i = 0 if rng.random() < 0.7 else i
            data = bytearray(frames[i])
            for _ in range(rng.randrange(1, 4)):
                if data:
                    k = rng.randrange(0, len(data))
                    data[k] ^= 1 << rng.randrange(0, 8)
            frames[i] = bytes(data)
        elif what == 1:
            frames[i] = frames[i][: rng.randrange(0, len(frames[i]) + 1)]
        elif what == 2:
            frames[i] = frames[i] + rng.randbytes(rng.randrange(1, 16))
        elif what == 3 and len(frames) > 1:
            del frames[i]
        elif what == 4:
            frames.insert(i, frames[i])
        elif what == 5 and len(frames) > 1:
            j = rng.randrange(0, len(frames))
            frames[i], frames[j] = frames[j], frames[i]
        else:
            frames.append(rng.randbytes(rng.randrange(0, 64)))
        return frames

    def random_frames(self) -> list[bytes]:
        rng, msgpack = self.rng, self.msgpack
        if rng.random() < 0.5:
            return [rng.randbytes(rng.randrange(0, 80)) for _ in range(rng.randrange(1, 4))]
        obj = self.junk() if rng.random() < 0.5 else {
            "version": 1, "kind": str(self.junk())[:12], "id": self.junk(), "fields": self.junk(), "arrays": self.junk()}
        try:
            return [msgpack.packb(obj, use_bin_type=True)]
        except (TypeError, ValueError, OverflowError):
            return [b"\xc1"]

    def message(self, segment_ids: list[int] | None = None, replies: bool = False) -> tuple[str, list[bytes]]:
        """(category, frames): a mix of every kind of input. With `segment_ids` (live fuzzing) a
        fresh request often addresses one of them; else a stored valid encoding is the base."""
        rng = self.rng
        r = rng.random()
        if segment_ids is not None and rng.random() < 0.3:
            frames = self.frames_of(self.valid_request(segment_ids))
        else:
            corpus = self.replies if replies and rng.random() < 0.5 else self.requests
            frames = corpus[rng.randrange(0, len(corpus))]
        if r < 0.15:
            return "valid", frames
        if r < 0.45:
            return "header", self.mutate_header(frames)
        if r < 0.75:
            return "bytes", self.mutate_bytes(frames)
        if r < 0.85:
            return "both", self.mutate_bytes(self.mutate_header(frames))
        return "random", self.random_frames()


# ------------------------------------------------------------------------ bytes on the wire


class TcpRecorder:
    """A loopback TCP relay to `target_port` that keeps every byte it passes, both ways.

    Clients connect to `endpoint`; what they send is in `upstream`, what comes back in `downstream`.
    No root and no capture tools: it sits in the path, as a man in the middle would.

    `hold_first`: on each connection, the client's first that many bytes reach the server in one
    piece (as a port proxy that is slow to connect its far side delivers them).
    """

    def __init__(self, target_port: int, hold_first: int = 0) -> None:
        self.target_port = target_port
        self.hold_first = hold_first
        self.connections = 0
        self.upstream = bytearray()
        self.downstream = bytearray()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
                self.connections += 1
            for src, dst, record, hold in ((client, server, self.upstream, self.hold_first),
                                           (server, client, self.downstream, 0)):
                thread = threading.Thread(target=self._pump, args=(src, dst, record, hold), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bytearray, hold: int = 0) -> None:
        src.settimeout(0.1)
        held = b""
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                break
            if not data:
                break
            with self._lock:
                record += data
            if hold:
                held += data
                if len(held) < hold:
                    continue
                data, held, hold = held, b"", 0
            try:
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(5)
        self._listener.close()
        for sock in self._sockets:
            sock.close()

    def __enter__(self) -> TcpRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------ soak workers


def soak_actor_main(endpoint: str, actor: int, seed: int, stop: Any, out: Any) -> None:
    """Commit episodes of mixed lengths until `stop`: most short, some long ones streamed in pieces.

    Puts ("soak-actor", actor, [(episode, length, episode id)], commit latencies in seconds, errors).
    A latency runs from the call that ends the episode (push_episode or commit) to its acknowledgement.
    """
    rng = np.random.default_rng(seed)
    acks: list[tuple[int, int, int]] = []
    latencies: list[float] = []
    errors: list[str] = []
    config = ClientConfig(endpoint=endpoint, timeout=60.0, name=f"soak-actor-{actor}")
    try:
        with ActorClient(config=config) as client:
            e = 0
            while not stop.is_set():
                kind = rng.random()
                n = int(rng.integers(1, 50) if kind < 0.7 else rng.integers(50, 500) if kind < 0.95 else rng.integers(500, 3000))
                rows = episode_rows(actor, e, n)
                if n < 200:
                    started = time.perf_counter()
                    receipt = client.push_episode(rows)
                else:
                    seg = client.segment()
                    for lo in range(0, n, 100):  # as an environment would: a step batch at a time
                        seg.extend({k: v[lo:lo + 100] for k, v in rows.items()})
                    started = time.perf_counter()
                    receipt = seg.commit()
                latencies.append(time.perf_counter() - started)
                acks.append((e, n, int(receipt.episode_id)))
                e += 1
                time.sleep(float(rng.uniform(0, 0.02)))  # an environment takes time too
    except Exception as exc:  # reported; the test fails on it
        errors.append(repr(exc))
    out.put(("soak-actor", actor, acks, latencies, errors))
    out.close()
    out.join_thread()


def soak_learner_main(endpoint: str, seed: int, stop: Any, out: Any) -> None:
    """Sample batches and sequences until `stop`; check every row. Puts ("soak-learner", seed,
    problems, reads, latencies)."""
    problems: list[str] = []
    latencies: list[float] = []
    reads = 0
    try:
        with LearnerClient(endpoint, timeout=60.0, name=f"soak-learner-{seed}") as learner:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    batch = learner.sample(256)
                    windows = learner.sample_sequences(32, 8)
                except NotEnoughDataError:
                    time.sleep(0.1)
                    continue
                latencies.append(time.perf_counter() - started)
                problems.extend(row_problems(batch))
                problems.extend(row_problems(windows))
                if not np.all(np.diff(windows["step"], axis=1) == 1):
                    problems.append("a sampled window skips steps")
                reads += 1
                time.sleep(0.01)
    except Exception as exc:
        problems.append(repr(exc))
    out.put(("soak-learner", seed, problems[:20], reads, latencies))
    out.close()
    out.join_thread()


def process_status(pid: int) -> dict[str, int]:
    """The numeric fields of /proc/PID/status, sizes in bytes ("VmRSS", "RssAnon", "Threads"...)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            words = value.split()
            if words and words[0].isdigit():
                fields[name] = int(words[0]) * (1024 if words[1:] == ["kB"] else 1)
    return fields


def process_figures(pid: int) -> tuple[int, int, int]:
    """(RSS bytes, open file descriptors, threads) of a live process, from /proc."""
    status = process_status(pid)
    return status.get("VmRSS", 0), len(os.listdir(f"/proc/{pid}/fd")), status.get("Threads", 0)


def children_of(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rpartition(")")[2].split()[1]) == pid:
                        found.append(int(entry))
    return found
