"""Service benchmarks: the h5replay server against a local ReplayBuffer and raw ZeroMQ, side by side.

Run from the repository root (not collected by pytest, whose testpaths is `tests`)::

    .venv/bin/python benchmarks/service.py                 # full run, about 2.5 minutes (4 on a busy machine)
    .venv/bin/python benchmarks/service.py --quick         # small sizes, < 60 s: a smoke test
    .venv/bin/python benchmarks/service.py --only sample --transport ipc --json /tmp/svc.json

What it measures (every figure is also printed as a ratio against a baseline from the same run;
targets are informational: PASS/MISS never changes the exit code):

1. ingest: episodes of 100 steps of {"obs": 7 x float32} and of {"obs": 84x84x3 uint8}, written by
   1, 4 and 16 spawned actor processes (`--actors`), each with its own `ActorClient`: one
   `segment()` per episode, filled by one `extend` of the 100 rows ("extend") or by 100 `append`
   calls ("append"; not with --quick); the segment's exit commits it and waits for the server's
   acknowledgement. Three more modes leave commits in flight (not with --quick): "pipelined",
   `push_episode(batch, wait=False)` per episode (up to `max_in_flight` unacknowledged), and
   "batched", `push_episodes` of 32 episodes a call with `wait=False` (several episodes a
   message), and "streamed": per-step `append`s and `commit(wait=False)` (episodes that wait for
   room in flight leave together in one message). All three end with `flush()`, so every episode
   is acknowledged before the clock stops. "async-extend" and "async-pipelined" are "extend" and
   "pipelined" through `AsyncActorClient` (one event loop per actor process); their target is
   >= 0.9x the blocking client in the same mode (issue 23). With small rows they send 2x ("pipelined"), 16x
   ("batched") and 4x ("streamed") the episodes: they would be over too soon. Their latency columns are the time of each call, which waits only for room in flight.
   The episodes are shared out among the actors (the same total for every actor count). Timing
   runs from a start barrier (every actor connected, its rows built) to the last actor's final
   commit acknowledgement. A fresh server (`ServerProcess`) and file for every case.
   Baselines, same run:
     * local: one process writes the same episodes into a local `ReplayBuffer`
       (`multiprocessing=True`, the server's SWMR mode) with `open_segment_writer` +
       `extend`/`append` + `commit_segment`.
     * raw zmq stream: the same actor processes send the same frames (the service's own encoded
       100-row `append` message) to a bare ROUTER in another process that only receives; each
       sender ends with an acknowledged request (an unacknowledged ipc:// tail can be lost).
       Raw senders go on past their share of episodes until 1 s (--quick: 0.2 s) has passed.
     * raw zmq pattern: the same, but with the service's exchanges per episode, each waited for
       as `ActorSegment` does: a round trip (open), the rows and their acknowledgement, a round
       trip (commit). The bare peer does no work, so this is the protocol's own ceiling.
     * raw zmq + h5py writer (small rows): the raw stream, its rows written by the sink into a
       plain h5py file with one low-level H5Dwrite per message (no validation, no staging, no
       publish, no durability): what ZeroMQ and HDF5 alone allow.
     * sustained h5py write, growing file (images): one process appends the same episodes to a
       chunked dataset it resizes as it goes, one low-level write per episode: this machine's
       sustained write rate.
   Targets: service "extend" >= 0.7x local for small rows; service >= 0.5x the raw zmq stream
   (MB/s) for images. Issue 9's, with 4 actors: small rows "extend" >= 1,000,000 rows/s and
   >= 0.5x the raw zmq + h5py writer, commit latency p99 <= 20 ms; small rows "append" (per-step
   streaming) >= 500,000 rows/s; images >= 0.8x the sustained write rate, and not below 1 actor.
2. sample: 256-row `sample` from 1,000,000 small rows and 20,000 images (--quick: 100k / 2k),
   written locally first. Local: `ReplayBuffer.sample(256)` on the file opened as an SWMR reader
   (what the server's reader process does) and as the writer. Wire: `LearnerClient.sample(256)`
   against a server on the same file (default: one reader process behind the writer's proxy
   thread), and, for comparison, against a server with `num_readers=0` (the writer's loop
   answers; no proxy hop), and `LearnerClient.batches(256, prefetch=8)` on the default server
   (requests kept in flight), and `AsyncLearnerClient.batches(256, prefetch=8)` (the asyncio
   client, the same plans on `zmq.asyncio`: its ratio to the blocking `batches`, target >= 0.9x). Raw: a bare ROUTER answering each request with a ready-made reply
   of the same frames. Targets (issue 9), for `batches`: >= 5,000 batches/s of small rows, and
   >= 0.5x local (SWMR reader) for images.
3. rss: one actor streams image episodes growing from 100 to 10,000 steps (--quick: to 1,000)
   into one server. /proc/<server pid>/status VmRSS and VmHWM (reset first when the kernel
   allows) at the start and after each episode, plus the peak sampled every 20 ms. Target: the
   server's peak grows by < 100 MB from the end of the first episode, although the last episode
   alone is 211 MB.

`--only zmq` runs the raw ZeroMQ baselines of section 1 alone; `--only ingest` runs section 1
without them. `--profile` runs each ingest server in a thread of this process under cProfile and
prints where its loop's time goes (e.g. `--only ingest --actors 4 --profile`).

Everything lives in a temporary directory deleted at the end; every server and process started
is stopped in a `finally`. Loopback only: tcp://127.0.0.1 on free ports, or ipc:// in the
temporary directory. Nothing is fsync'd. The machine is noisy (2 vCPUs shared by the server, its
reader, the ZeroMQ I/O threads and the actors): read figures as orders of magnitude and compare
ratios from the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import itertools
import json
import multiprocessing
import os
import pstats
import queue
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import h5py
import numpy as np
import zmq

try:
    import h5replay  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.client.aio import AsyncLearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.server import Server, ServerProcess
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

SMALL, IMAGE = "7xf32", "84x84x3u8"
ROW: dict[str, tuple[tuple[int, ...], np.dtype[Any]]] = {
    SMALL: ((7,), np.dtype(np.float32)), IMAGE: ((84, 84, 3), np.dtype(np.uint8))}
# How actors send episodes: a segment filled by one extend or by per-step appends, each commit
# waited for; push_episode(wait=False) ("pipelined": up to max_in_flight commits in flight);
# push_episodes of BATCHED_EPISODES episodes a call, wait=False ("batched": several episodes a
# message); and per-step appends with commit(wait=False) ("streamed": under load the client puts
# the episodes waiting for room in flight in one message).
# "async-extend" and "async-pipelined" are "extend" and "pipelined" through AsyncActorClient
# (h5replay.client.aio, the same core plans on zmq.asyncio), one event loop per actor process.
MODES = ("extend", "append", "pipelined", "batched", "streamed", "async-extend", "async-pipelined")
LOCAL_MODES = ("extend", "append")  # the local baseline has no counterpart of the others
IN_FLIGHT_MODES = ("pipelined", "batched", "streamed")
ASYNC_MODES = ("async-extend", "async-pipelined")
BATCHED_EPISODES = 32
# Small rows in the in-flight modes: this many times the episodes, or they are over too soon.
IN_FLIGHT_SCALE = {"pipelined": 16, "batched": 16, "streamed": 4, "async-pipelined": 16}
BATCH = 256
PREFETCH = 8  # batches a pipelined learner keeps requested ahead
PIPELINED = f"wire, LearnerClient.batches(prefetch={PREFETCH})"
ASYNC_PIPELINED = f"wire, AsyncLearnerClient.batches(prefetch={PREFETCH})"
# A learner on the file's host (ClientConfig.local_reads, the default) draws from its own SWMR view
# of the file (the wire rows above turn it off).
SAME_HOST = "same host, LearnerClient.sample"
SAME_HOST_PIPELINED = f"same host, LearnerClient.batches(prefetch={PREFETCH})"
SAME_HOST_ASYNC = f"same host, AsyncLearnerClient.batches(prefetch={PREFETCH})"
SAME_HOST_TARGET = 0.8  # same-host batches against a local SWMR reader of the same rows (issue 26)
ASYNC_VS_BLOCKING_TARGET = 0.9  # AsyncLearnerClient.batches against the blocking batches (issue 23)
SMALL_BATCHES_TARGET = 5_000  # sample(256) batches/s of small rows over the wire, one learner (issue 9)
SMALL_INGEST_TARGET = 1_000_000  # rows/s, small rows, whole episodes (extend), 4 actors (issue 9)
STREAM_INGEST_TARGET = 500_000  # rows/s, small rows streamed step by step (append), 4 actors (issue 9)
PIPELINED_VS_STREAM_TARGET = 0.4  # push_episode(wait=False), small rows, against the raw stream into h5py (issue 26)
COMMIT_P99_TARGET_MS = 20.0  # per-episode commit latency, small rows, 4 actors (issue 9)
RAW_H5 = "raw zmq + h5py writer"  # the stream's rows written into a plain file by the sink
SUSTAINED = "sustained h5py write, growing file"  # this machine's write rate, one process
START_TIMEOUT = 120.0  # seconds for spawned processes to import, connect and reach the barrier
perf = time.perf_counter  # CLOCK_MONOTONIC on Linux: comparable across processes
_TICK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Sizes:
    episode_len: int
    episodes: dict[str, int]  # per ingest case, shared out among the actors
    case_budget: float  # seconds: actors stop starting episodes after this
    sample_rows: dict[str, int]
    sample_batches: int  # at most, per method
    sample_budget: float  # seconds per method, at most
    raw_min_seconds: float = 1.0  # raw zmq cases send more episodes, until this long
    rss_lengths: list[int] = field(default_factory=list)
    modes: tuple[str, ...] = MODES  # how actors fill segments


FULL = Sizes(100, {SMALL: 2_000, IMAGE: 192}, 30.0, {SMALL: 1_000_000, IMAGE: 20_000}, 2_000, 5.0, 1.0,
             [100, 300, 1_000, 3_000, 10_000])
QUICK = Sizes(100, {SMALL: 160, IMAGE: 16}, 4.0, {SMALL: 100_000, IMAGE: 2_000}, 100, 0.5, 0.2, [100, 300, 1_000],
              ("extend", "async-extend"))


def space_of(kind: str) -> DictSpace:
    shape, dtype = ROW[kind]
    low, high = (0, 255) if kind == IMAGE else (-np.inf, np.inf)
    return DictSpace({"obs": BoxSpace(low, high, shape, dtype)})


def row_bytes(kind: str) -> int:
    shape, dtype = ROW[kind]
    return int(np.prod(shape)) * dtype.itemsize


def make_rows(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == SMALL:
        return rng.standard_normal((n, 7), dtype=np.float32)
    return rng.integers(0, 256, (n, 84, 84, 3), dtype=np.uint8)


def episode_pool(kind: str, episode_len: int, seed: int) -> list[np.ndarray]:
    """Two distinct episodes' rows; writers alternate between them (the bytes never matter)."""
    rows = make_rows(kind, 2 * episode_len, seed)
    return [rows[:episode_len], rows[episode_len:]]


def latency(times: list[float]) -> dict[str, float]:
    if not times:
        return {"p50_ms": float("nan"), "p99_ms": float("nan")}
    t = np.asarray(times)
    return {"p50_ms": float(np.percentile(t, 50)) * 1e3, "p99_ms": float(np.percentile(t, 99)) * 1e3}


def fmt(x: float) -> str:
    if x != x:  # nan
        return "-"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def fmt_ratio(ratio: float | None) -> str:
    return "" if ratio is None else f"{ratio:.2f}x"


def verdict(ratio: float, target: float) -> str:
    return "PASS" if ratio >= target else "MISS"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    if title:
        print(f"\n{title}")
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
    print(line + "\n" + "-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    sys.stdout.flush()


# ------------------------------------------------------------------------------ endpoints, /proc


def free_tcp_port(taken: set[int]) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in taken:
            taken.add(port)
            return port


class Endpoints:
    """Fresh loopback endpoints for each server: free tcp ports on 127.0.0.1, or ipc:// in tmp."""

    def __init__(self, tmp: str, transport: str) -> None:
        self.tmp, self.transport = tmp, transport
        self._count = 0
        self._ports: set[int] = set()

    def pair(self) -> tuple[str, str]:
        self._count += 1
        if self.transport == "ipc":
            base = os.path.join(self.tmp, f"s{self._count}")
            return f"ipc://{base}.w", f"ipc://{base}.r"
        return (f"tcp://127.0.0.1:{free_tcp_port(self._ports)}", f"tcp://127.0.0.1:{free_tcp_port(self._ports)}")


def proc_status(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of `pid` in MB (empty when the process is gone)."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    out[key] = int(value.split()[0]) / 1024
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid`, all its threads (ZeroMQ I/O threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15)
    except OSError:
        return float("nan")


def reset_hwm(pid: int) -> bool:
    """Reset VmHWM of `pid` to its current RSS (Linux >= 4.0, same user)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def children_rss(pid: int) -> float:
    """Summed VmRSS (MB) of the direct children of `pid` (the server's reader processes)."""
    total = 0.0
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            for child in f.read().split():
                total += proc_status(int(child)).get("VmRSS", 0.0)
    return total


# ------------------------------------------------------------------------------ spawned workers
# Module-level functions: the spawn start method imports this module in each child.


def _actor_main(endpoint: str, kind: str, mode: str, num_episodes: int, episode_len: int, seed: int,
                budget: float, barrier: Any, out: Any) -> None:
    """One actor: ActorClient, `num_episodes` segments of `episode_len` steps, then report."""
    if mode in ASYNC_MODES:
        _async_actor_main(endpoint, kind, mode, num_episodes, episode_len, seed, budget, barrier, out)
        return
    try:
        client = ActorClient(endpoint, timeout=60.0, name=f"bench-actor-{seed}")
        try:
            pool = episode_pool(kind, episode_len, seed)
            batches = [{"obs": rows} for rows in pool]
            steps = [[{"obs": row} for row in rows] for rows in pool]
            barrier.wait(START_TIMEOUT)
            t0 = perf()
            times, done = [], 0
            if mode in IN_FLIGHT_MODES:  # latency: the time of each call (it waits only for room in flight)
                per_call = BATCHED_EPISODES if mode == "batched" else 1
                for e in range(0, num_episodes, per_call):
                    ts = perf()
                    k = min(per_call, num_episodes - e)
                    if mode == "batched":
                        client.push_episodes([batches[(e + j) % 2] for j in range(k)], wait=False)
                    elif mode == "streamed":
                        seg = client.segment()
                        for step in steps[e % 2]:
                            seg.append(step)
                        seg.commit(wait=False)
                    else:
                        client.push_episode(batches[e % 2], wait=False)
                    times.append(perf() - ts)
                    done += k
                    if perf() - t0 > budget:
                        break
                client.flush()  # every episode acknowledged before the clock stops
                num_episodes = 0
            for e in range(num_episodes):
                ts = perf()
                with client.segment() as seg:
                    if mode == "extend":
                        seg.extend(batches[e % 2])
                    else:
                        for step in steps[e % 2]:
                            seg.append(step)
                times.append(perf() - ts)
                done += 1
                if perf() - t0 > budget:
                    break
            t1 = perf()
        finally:
            client.close()
        out.put({"t0": t0, "t1": t1, "episodes": done, "rows": done * episode_len, "times": times})
    except BaseException:
        barrier.abort()
        out.put({"error": traceback.format_exc()})


def _async_actor_main(endpoint: str, kind: str, mode: str, num_episodes: int, episode_len: int, seed: int,
                      budget: float, barrier: Any, out: Any) -> None:
    """One actor on asyncio: AsyncActorClient, the episodes of "extend" (a segment, one extend,
    each commit awaited) or "pipelined" (push_episode(wait=False), then flush), then report."""
    import asyncio

    from h5replay.client.aio import AsyncActorClient

    async def run() -> dict[str, Any]:
        async with AsyncActorClient(endpoint, timeout=60.0, name=f"bench-actor-{seed}") as client:
            batches = [{"obs": rows} for rows in episode_pool(kind, episode_len, seed)]
            await asyncio.to_thread(barrier.wait, START_TIMEOUT)
            t0 = perf()
            times, done = [], 0
            for e in range(num_episodes):
                ts = perf()
                if mode == "async-pipelined":
                    await client.push_episode(batches[e % 2], wait=False)
                else:
                    async with client.segment() as seg:
                        await seg.extend(batches[e % 2])
                times.append(perf() - ts)
                done += 1
                if perf() - t0 > budget:
                    break
            await client.flush()  # every episode acknowledged before the clock stops
            t1 = perf()
        return {"t0": t0, "t1": t1, "episodes": done, "rows": done * episode_len, "times": times}

    try:
        out.put(asyncio.run(run()))
    except BaseException:
        barrier.abort()
        out.put({"error": traceback.format_exc()})


def _raw_sender_main(endpoint: str, kind: str, pattern: bool, num_episodes: int, episode_len: int,
                     min_seconds: float, seed: int, budget: float, barrier: Any, out: Any) -> None:
    """A bare DEALER sending the service's own append frames; `pattern` adds its round trips.
    Sends `num_episodes`, and more until `min_seconds` have passed (a stream of a few MB of
    small rows lasts a few ms: too short to time)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 1000
    sock.sndhwm = 8  # a stream, not a backlog: the default (1000) would queue 2 GB of images here
    try:
        sock.connect(endpoint)

        def round_trip(tag: bytes) -> None:
            sock.send(tag)
            if not sock.poll(60_000):
                raise TimeoutError("the raw sink did not answer within 60 s")
            sock.recv()

        pool = episode_pool(kind, episode_len, seed)
        messages = [P.encode(P.Append(1, 1, episode_len, {"obs": rows})) for rows in pool]
        round_trip(b"H")  # connected before the clock starts, as an ActorClient's hello
        barrier.wait(START_TIMEOUT)
        t0 = perf()
        times, done, nbytes = [], 0, 0
        for e in itertools.count():
            if e >= num_episodes and perf() - t0 >= min_seconds:
                break
            ts = perf()
            if pattern:
                round_trip(b"R")
            frames = messages[e % 2]
            sock.send_multipart(frames, copy=False)
            nbytes += sum(len(f) for f in frames)
            if pattern:  # as ActorSegment.commit: wait for the rows' acknowledgement, then commit
                if not sock.poll(60_000):
                    raise TimeoutError("the raw sink did not acknowledge the rows within 60 s")
                sock.recv()
                round_trip(b"R")
            times.append(perf() - ts)
            done += 1
            if perf() - t0 > budget:
                break
        round_trip(b"E")  # everything before it was received
        t1 = perf()
        out.put({"t0": t0, "t1": t1, "episodes": done, "rows": done * episode_len, "wire_bytes": nbytes,
                 "times": times if pattern else []})
    except BaseException:
        barrier.abort()
        out.put({"error": traceback.format_exc()})
    finally:
        sock.close()
        ctx.term()


class _RawFile:
    """Rows written as they come into a contiguous h5py dataset of `capacity` rows (a ring), one
    low-level H5Dwrite per message: no validation, no staging, no publish, no flush until close."""

    def __init__(self, path: str, kind: str, capacity: int) -> None:
        self.shape, self.dtype = ROW[kind]
        self.path, self.capacity, self.position = path, capacity, 0
        self.file = h5py.File(path, "w", libver=("v110", "v114"))
        dataset = self.file.create_dataset("obs", shape=(capacity, *self.shape), dtype=self.dtype)
        self.dsid, self.fspace = dataset.id, dataset.id.get_space()

    def write(self, frame: Any) -> None:
        rows = np.frombuffer(frame, self.dtype).reshape(-1, *self.shape)
        start = self.position % self.capacity
        if start + len(rows) > self.capacity:
            start = 0
        self.fspace.select_hyperslab((start,) + (0,) * len(self.shape), rows.shape)
        self.dsid.write(h5py.h5s.create_simple(rows.shape), self.fspace, rows)
        self.position = start + len(rows)

    def close(self) -> None:
        self.file.flush()
        self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _raw_sink_main(endpoint: str, kind: str, ack_rows: bool, ready: Any, stop: Any, write_path: str | None = None,
                   capacity: int = 0) -> None:
    """A bare ROUTER: drops data frames (or, with `write_path`, writes their rows into a plain h5py
    file), acknowledging each when `ack_rows`, and answers requests at once; "S" gets a
    ready-made 256-row sample reply (the same frames a server's reader sends)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    raw_file = _RawFile(write_path, kind, capacity) if write_path else None
    try:
        sock.bind(endpoint)
        rows = make_rows(kind, BATCH, seed=99)
        ids = np.arange(BATCH, dtype=np.int64)
        sample = P.encode(P.SampleReply(1, 1, 0, 0, BATCH, ids, ids.astype(np.uint64), np.full(BATCH, 1 / BATCH),
                                        {"obs": rows}))
        ready.set()
        while not stop.is_set():
            if not sock.poll(100):
                continue
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                if len(frames) == 2:  # a control request: one frame after the routing id
                    tag = frames[1].bytes
                    reply = sample if tag == b"S" else [b"ok"]
                    sock.send_multipart([frames[0], *reply], copy=False)
                else:
                    if raw_file is not None:
                        raw_file.write(frames[-1].buffer)
                    if ack_rows:
                        sock.send_multipart([frames[0], b"ok"])
    finally:
        if raw_file is not None:
            raw_file.close()
        sock.close(0)
        ctx.term()


class RawSink:
    """The bare ZeroMQ peer, in a spawned process; stopped (then killed) in `stop`."""

    def __init__(self, endpoint: str, kind: str, ack_rows: bool = False, write_path: str | None = None,
                 capacity: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._ready, self._stop = ctx.Event(), ctx.Event()
        self.process = ctx.Process(target=_raw_sink_main, args=(endpoint, kind, ack_rows, self._ready, self._stop,
                                                                write_path, capacity),
                                   name="bench-raw-sink", daemon=True)
        self.process.start()
        if not self._ready.wait(START_TIMEOUT):
            self.stop()
            raise RuntimeError("the raw ZeroMQ sink did not start")

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    def stop(self) -> None:
        self._stop.set()
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)


def _pool_main(inbox: Any, barrier: Any, out: Any) -> None:
    """A pool worker: runs tasks (the name of a worker function above, its arguments) until None."""
    out.put({"ready": True})
    while True:
        task = inbox.get()
        if task is None:
            return
        name, args = task
        globals()[name](*args, barrier, out)


class WorkerPool:
    """`n` spawned processes reused for every case with that many actors (spawning 16 processes
    that import numpy, h5py and zmq takes about 15 s on 2 vCPUs). Start barrier: `n` + this one."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.n = n
        self.barrier, self.out = ctx.Barrier(n + 1), ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_pool_main, args=(inbox, self.barrier, self.out), name=f"bench-worker-{i}",
                                  daemon=True) for i, inbox in enumerate(self.inboxes)]
        for proc in self.procs:
            proc.start()
        # Wait for every worker's imports: cases must not share the CPUs with start-up work.
        deadline = time.monotonic() + START_TIMEOUT
        ready = 0
        while ready < n:
            try:
                ready += int("ready" in self.out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    self.close()
                    raise RuntimeError(f"only {ready} of {n} worker processes started") from None

    def run(self, target: Any, args: tuple[Any, ...], watch_pid: int) -> dict[str, Any]:
        """Run `target(*args, seed, budget)` in every worker (`args` ends with a base seed and the
        budget), release them together at the barrier, collect. Returns the summed figures, from
        the first worker's start to the last one's final acknowledgement, and the CPU share
        `watch_pid` (the server) used meanwhile."""
        *head, seed, budget = args
        for i, inbox in enumerate(self.inboxes):
            inbox.put((target.__name__, (*head, seed * 1000 + i, budget)))  # a distinct seed per worker
        results: list[dict[str, Any]] = []
        try:
            self.barrier.wait(START_TIMEOUT)
        except threading.BrokenBarrierError:
            pass  # a worker failed before the start: its error is in the queue
        cpu0, wall0 = cpu_seconds(watch_pid), perf()
        deadline = time.monotonic() + START_TIMEOUT + 600
        while len(results) < self.n:
            try:
                results.append(self.out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise RuntimeError(f"only {len(results)} of {self.n} workers reported") from None
                continue
            if "error" in results[-1]:
                raise RuntimeError("a worker failed:\n" + results[-1]["error"])
        cpu, wall = cpu_seconds(watch_pid) - cpu0, perf() - wall0
        episodes = sum(r["episodes"] for r in results)
        seconds = max(r["t1"] for r in results) - min(r["t0"] for r in results)
        times = [t for r in results for t in r["times"]]
        return {"seconds": seconds, "episodes": episodes, "peer_cpu_us_per_seg": 1e6 * cpu / max(1, episodes),
                "rows": sum(r["rows"] for r in results), "wire_bytes": sum(r.get("wire_bytes", 0) for r in results),
                "peer_cpu_pct": 100 * cpu / wall if wall > 0 else float("nan"), **latency(times)}

    def close(self) -> None:
        for inbox in self.inboxes:
            with contextlib.suppress(Exception):
                inbox.put(None)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)


def rates(m: dict[str, Any], kind: str) -> dict[str, Any]:
    s = m["seconds"]
    m.update(rows_per_s=m["rows"] / s, mb_per_s=m["rows"] * row_bytes(kind) / s / 1e6, seg_per_s=m["episodes"] / s)
    return m


# ------------------------------------------------------------------------------ 1. ingest


def ingest_local(path: str, kind: str, mode: str, sizes: Sizes) -> dict[str, Any]:
    """The same episodes by one process into a local ReplayBuffer (SWMR writer, like the server's)."""
    n_ep, length = sizes.episodes[kind], sizes.episode_len
    rb = ReplayBuffer.create(space_of(kind), n_ep * length, path, multiprocessing=True)
    pool = episode_pool(kind, length, seed=1)
    batches = [{"obs": rows} for rows in pool]
    steps = [[{"obs": row} for row in rows] for rows in pool]
    try:
        times, done = [], 0
        t0 = perf()
        for e in range(n_ep):
            ts = perf()
            writer = rb.open_segment_writer()
            if mode == "extend":
                writer.extend(batches[e % 2])
            else:
                for step in steps[e % 2]:
                    writer.append(step)
            rb.commit_segment(writer)
            times.append(perf() - ts)
            done += 1
            if perf() - t0 > sizes.case_budget:
                break
        seconds = perf() - t0
        if len(rb) != done * length:
            raise AssertionError(f"local buffer holds {len(rb)} rows, expected {done * length}")
    finally:
        rb.close()
        os.unlink(path)
    return rates({"seconds": seconds, "episodes": done, "rows": done * length, **latency(times)}, kind)


class ThreadServer:
    """--profile: the server's loop in a thread of this process under cProfile (wall clock: a
    CPU-time timer costs ~3 us a call here and would swamp the figures; time spent waiting shows
    as `poll`, and time descheduled on the shared CPUs lands on whatever was running)."""

    def __init__(self, config: ServerConfig) -> None:
        self.server = Server(config)
        self.profile = cProfile.Profile()
        ready = threading.Event()
        self.thread = threading.Thread(target=self.profile.runcall, args=(self.server.run, ready), daemon=True)
        self.thread.start()
        if not ready.wait(START_TIMEOUT):
            self.stop()
            raise RuntimeError("the in-process server did not start")

    @property
    def pid(self) -> int:
        return os.getpid()  # figures of this whole process: CPU% and RSS are not the server's alone

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(30)

    def report(self, title: str, episodes: int, top: int = 14) -> None:
        out = io.StringIO()
        stats = pstats.Stats(self.profile, stream=out)
        raw: dict[tuple[str, int, str], tuple[Any, ...]] = getattr(stats, "stats", {})
        loop = sum(v[3] for k, v in raw.items() if k[2] == "_loop" and k[0].endswith("writer.py"))
        print(f"\n  profile of the server loop, {title}: {loop / max(1, episodes) * 1e6:.0f} us of wall time per "
              f"episode in Server._loop (profiled, so inflated), top {top} functions by own time:")
        stats.sort_stats("tottime").print_stats(top)
        lines = out.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        print("\n".join("    " + line for line in lines[start:] if line.strip()))


def ingest_service(path: str, endpoints: Endpoints, kind: str, mode: str, pool: WorkerPool, sizes: Sizes,
                   profile: bool = False) -> dict[str, Any]:
    """One ActorClient per pool worker into a fresh server; checks the server holds every row."""
    n_ep, length = sizes.episodes[kind] * (IN_FLIGHT_SCALE.get(mode, 1) if kind == SMALL else 1), sizes.episode_len
    bind, read_bind = endpoints.pair()
    config = ServerConfig(path=path, space=space_of(kind), capacity=n_ep * length, bind=bind, read_bind=read_bind)
    server: ServerProcess | ThreadServer = ThreadServer(config) if profile else ServerProcess(config)
    try:
        start = proc_status(server.pid)
        per_actor = max(1, n_ep // pool.n)
        m = pool.run(_actor_main, (bind, kind, mode, per_actor, length, 1, sizes.case_budget), server.pid)
        end = proc_status(server.pid)
        with LearnerClient(bind, timeout=30.0) as learner:
            info = learner.info()
        if info["length"] != m["rows"] or info["commits"] != m["episodes"]:
            raise AssertionError(f"server holds {info['length']} rows in {info['commits']} commits; the actors "
                                 f"sent {m['rows']} rows in {m['episodes']} episodes")
        m.update(server_rss_mb=end.get("VmRSS"), server_hwm_mb=end.get("VmHWM"), server_rss0_mb=start.get("VmRSS"))
    finally:
        server.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    if isinstance(server, ThreadServer):
        server.report(f"{kind} {mode}, {pool.n} actor(s)", m["episodes"])
    return rates(m, kind)


def ingest_raw(endpoints: Endpoints, kind: str, pattern: bool, pool: WorkerPool, sizes: Sizes,
               write_path: str | None = None) -> dict[str, Any]:
    bind, _ = endpoints.pair()
    capacity = sizes.episodes[kind] * sizes.episode_len
    sink = RawSink(bind, kind, ack_rows=pattern, write_path=write_path, capacity=capacity)
    try:
        per_actor = max(1, sizes.episodes[kind] // pool.n)
        m = pool.run(_raw_sender_main, (bind, kind, pattern, per_actor, sizes.episode_len, sizes.raw_min_seconds, 1,
                                        sizes.case_budget), sink.pid)
    finally:
        sink.stop()
    m = rates(m, kind)
    m["wire_mb_per_s"] = m["wire_bytes"] / m["seconds"] / 1e6
    return m


def sustained_write(path: str, kind: str, sizes: Sizes) -> dict[str, Any]:
    """This machine's sustained write rate into a growing file: one process appends the case's
    episodes (the same rows) to a chunked h5py dataset it resizes as it goes, one low-level
    H5Dwrite per episode, then flushes. The image ingest target's baseline."""
    shape, dtype = ROW[kind]
    n_ep, length = sizes.episodes[kind], sizes.episode_len
    pool = episode_pool(kind, length, seed=1)
    chunk_rows = max(1, (1 << 20) // row_bytes(kind))
    try:
        with h5py.File(path, "w", libver=("v110", "v114")) as f:
            ds = f.create_dataset("obs", shape=(0, *shape), maxshape=(None, *shape), dtype=dtype,
                                  chunks=(chunk_rows, *shape))
            memory = h5py.h5s.create_simple((length, *shape))
            times = []
            t0 = perf()
            for e in range(n_ep):
                ts = perf()
                ds.resize((e + 1) * length, axis=0)
                space = ds.id.get_space()
                space.select_hyperslab((e * length,) + (0,) * len(shape), (length, *shape))
                ds.id.write(memory, space, pool[e % 2])
                times.append(perf() - ts)
            f.flush()
            seconds = perf() - t0
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return rates({"seconds": seconds, "episodes": n_ep, "rows": n_ep * length, **latency(times)}, kind)


def run_case(name: str, fn: Any, *args: Any) -> dict[str, Any]:
    """Run one case; a failure is printed and recorded, and the run goes on with the next case."""
    t0 = perf()
    try:
        m = fn(*args)
    except Exception as exc:  # a benchmark reports a broken case rather than losing the others
        print(f"  {name}: FAILED after {perf() - t0:.1f} s: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}
    print(f"  {name}: {perf() - t0:.1f} s")
    sys.stdout.flush()
    return m  # type: ignore[no-any-return]


def run_ingest(tmp: str, endpoints: Endpoints, sizes: Sizes, actor_counts: list[int], service: bool,
               raw: bool, profile: bool = False) -> dict[str, Any]:
    kinds = (SMALL, IMAGE)
    cases: dict[str, dict[str, dict[str, Any]]] = {kind: {} for kind in kinds}
    paths = {kind: os.path.join(tmp, f"ingest-{kind}.h5") for kind in kinds}
    print("\n1. ingest (progress: wall time of each case, start-up included)")
    if service:
        for kind in kinds:
            ingest_local(paths[kind], kind, "extend", sizes)  # warm-up, untimed: page cache, allocator
            for mode in (m for m in sizes.modes if m in LOCAL_MODES):
                name = f"local ReplayBuffer, {mode}"
                cases[kind][name] = run_case(f"{kind} {name}", ingest_local, paths[kind], kind, mode, sizes)
        cases[IMAGE][SUSTAINED] = run_case(f"{IMAGE} {SUSTAINED}", sustained_write, paths[IMAGE], IMAGE, sizes)
    for actors in actor_counts:
        t0 = perf()
        pool = WorkerPool(actors)
        try:
            for kind in kinds:
                got = cases[kind]
                if raw:
                    for pattern in (False, True):
                        name = f"raw zmq {'pattern' if pattern else 'stream'}, {actors} proc"
                        got[name] = run_case(f"{kind} {name}", ingest_raw, endpoints, kind, pattern, pool, sizes)
                    if kind == SMALL:
                        name = f"{RAW_H5}, {actors} proc"
                        got[name] = run_case(f"{kind} {name}", ingest_raw, endpoints, kind, False, pool, sizes,
                                             paths[kind])
                if service:
                    for mode in sizes.modes:
                        name = f"service {mode}, {actors} actor{'s' if actors > 1 else ''}"
                        got[name] = run_case(f"{kind} {name}", ingest_service, paths[kind], endpoints, kind, mode,
                                             pool, sizes, profile)
        finally:
            pool.close()
        print(f"  ({actors} actor process(es): {perf() - t0:.1f} s in all, spawning them included)")
        sys.stdout.flush()
    for kind in kinds:
        n_ep, length, got = sizes.episodes[kind], sizes.episode_len, cases[kind]
        table = []
        for name, m in got.items():
            if "error" in m:
                table.append([name, "FAILED", m["error"][:60], *([""] * 11)])
                continue
            actors_here = name.rsplit(", ", 1)[1].split()[0] if "zmq" in name or "service" in name else ""
            local = got.get(f"local ReplayBuffer, {name.split(', ')[0].split()[-1]}") if "service" in name else None
            stream = got.get(f"raw zmq stream, {actors_here} proc")
            local = None if local is None or "error" in local else local
            stream = None if stream is None or "error" in stream else stream
            m["vs_local"] = m["rows_per_s"] / local["rows_per_s"] if local else None
            m["vs_raw_stream"] = m["mb_per_s"] / stream["mb_per_s"] if stream and "stream" not in name else None
            checks = ingest_targets(name, kind, m, got, actors_here)
            m["targets"] = checks
            m["target_met"] = all(ok for _, ok in checks) if checks else None
            check = "; ".join(f"{what} {'PASS' if ok else 'MISS'}" for what, ok in checks)
            hwm = f"{m['server_hwm_mb']:.0f}" if m.get("server_hwm_mb") else ""
            table.append([name, f"{m['seconds']:.2f}", fmt(m["rows_per_s"]), fmt(m["mb_per_s"]), fmt(m["seg_per_s"]),
                          fmt(m["p50_ms"]), fmt(m["p99_ms"]), f"{m.get('peer_cpu_pct', float('nan')):.0f}"
                          if "peer_cpu_pct" in m else "", fmt(m["peer_cpu_us_per_seg"]) if "peer_cpu_us_per_seg" in m
                          else "", hwm, fmt_ratio(m["vs_local"]), fmt_ratio(m["vs_raw_stream"]),
                          check])
        print_table(f"1. ingest {kind}: {n_ep} episodes x {length} steps ({n_ep * length * row_bytes(kind) / 1e6:.0f} MB) "
                    f"per case, shared out among the actors (at most {sizes.case_budget:g} s); latency = per episode; "
                    "peer = the server (or raw sink) process, all threads: CPU / wall, and CPU per episode",
                    ["case", "s", "rows/s", "MB/s", "seg/s", "p50 ms", "p99 ms", "peer CPU%", "peer us/seg", "srv HWM MB",
                     "vs local", "vs raw", "target"], table)
    return cases


def ingest_targets(name: str, kind: str, m: dict[str, Any], got: dict[str, dict[str, Any]],
                   actors: str) -> list[tuple[str, bool]]:
    """The ingest targets a case has, each (what, met): issue 9's and the earlier ones."""
    def ok(case: str) -> dict[str, Any] | None:
        found = got.get(case)
        return None if found is None or "error" in found else found

    checks: list[tuple[str, bool]] = []
    if not name.startswith("service"):
        return checks
    mode = name.split(",")[0].split()[-1]
    four = actors == "4"
    if kind == SMALL and mode in ("extend", "pipelined", "batched"):  # whole episodes, each acknowledged
        if m["vs_local"] is not None:
            checks.append((f"{m['vs_local']:.2f}x local >=0.7x", m["vs_local"] >= 0.7))
        if four:
            checks.append((f">={fmt(SMALL_INGEST_TARGET)} rows/s", m["rows_per_s"] >= SMALL_INGEST_TARGET))
            raw_h5 = ok(f"{RAW_H5}, 4 proc")
            if raw_h5 is not None:
                ratio = m["rows_per_s"] / raw_h5["rows_per_s"]
                checks.append((f"{ratio:.2f}x raw zmq+h5py >=0.5x", ratio >= 0.5))
            if mode == "extend":
                checks.append((f"commit p99 {m['p99_ms']:.1f} ms <=20", m["p99_ms"] <= COMMIT_P99_TARGET_MS))
    if kind == SMALL and mode == "pipelined" and not four:  # issue 26 (4 actors: >= 0.5x above), against
        stream = ok(f"{RAW_H5}, {actors} proc")  # the raw unacknowledged stream into h5py
        if stream is not None:
            ratio = m["rows_per_s"] / stream["rows_per_s"]
            checks.append((f"{ratio:.2f}x raw zmq+h5py >={PIPELINED_VS_STREAM_TARGET}x",
                           ratio >= PIPELINED_VS_STREAM_TARGET))
    if kind == SMALL and mode in ("append", "streamed") and four:
        checks.append((f">={fmt(STREAM_INGEST_TARGET)} rows/s", m["rows_per_s"] >= STREAM_INGEST_TARGET))
    if mode in ASYNC_MODES:  # issue 23: the asyncio actor beside the blocking one, same mode
        blocking = ok(f"service {mode.removeprefix('async-')}, {name.rsplit(', ', 1)[1]}")
        if blocking is not None:
            ratio = m["rows_per_s"] / blocking["rows_per_s"]
            checks.append((f"{ratio:.2f}x blocking >={ASYNC_VS_BLOCKING_TARGET}x", ratio >= ASYNC_VS_BLOCKING_TARGET))
        return checks
    if kind == IMAGE:
        if m["vs_raw_stream"] is not None:
            checks.append((f"{m['vs_raw_stream']:.2f}x raw stream >=0.5x", m["vs_raw_stream"] >= 0.5))
        sustained = ok(SUSTAINED)
        if four and sustained is not None:
            ratio = m["mb_per_s"] / sustained["mb_per_s"]
            checks.append((f"{ratio:.2f}x sustained write >=0.8x", ratio >= 0.8))
        one = ok(f"service {mode}, 1 actor")
        if four and one is not None:
            checks.append(("not below 1 actor", m["mb_per_s"] >= one["mb_per_s"]))
    return checks


# ------------------------------------------------------------------------------ 2. sample


def fill_file(path: str, kind: str, n: int, episode_len: int) -> None:
    """`n` rows in episodes of `episode_len`, written locally (the sampling source for every method)."""
    rb = ReplayBuffer.create(space_of(kind), n, path, multiprocessing=True)
    block = max(episode_len, ((16 << 20) // row_bytes(kind)) // episode_len * episode_len)
    try:
        for a in range(0, n, block):
            rows = make_rows(kind, min(block, n - a), seed=1000 + a)
            for j in range(0, len(rows), episode_len):
                rb.extend({"obs": rows[j : j + episode_len]})
                rb.end_episode()
        rb.flush()
    finally:
        rb.close()


def time_batches(fn: Any, sizes: Sizes) -> dict[str, Any]:
    """Warm up (up to 10 batches or a quarter of the budget), then time up to the count/budget."""
    t0 = perf()
    for _ in range(10):
        fn()
        if perf() - t0 > sizes.sample_budget / 4:
            break
    times: list[float] = []
    t0 = perf()
    while len(times) < sizes.sample_batches and perf() - t0 < sizes.sample_budget:
        ts = perf()
        fn()
        times.append(perf() - ts)
    seconds = perf() - t0
    return {"seconds": seconds, "batches": len(times), "batches_per_s": len(times) / seconds, **latency(times)}


def time_async_batches(endpoint: str, sizes: Sizes, local_reads: bool = False) -> dict[str, Any]:
    """`time_batches` of `AsyncLearnerClient.batches(BATCH, prefetch=PREFETCH)` on an event loop of its own."""
    import asyncio

    async def timed() -> dict[str, Any]:
        config = ClientConfig(endpoint=endpoint, timeout=30.0, local_reads=local_reads)
        async with AsyncLearnerClient(endpoint, config=config) as learner:
            stream: Any = learner.batches(BATCH, prefetch=PREFETCH)
            try:
                t0 = perf()
                for _ in range(10):
                    await stream.__anext__()
                    if perf() - t0 > sizes.sample_budget / 4:
                        break
                times: list[float] = []
                t0 = perf()
                while len(times) < sizes.sample_batches and perf() - t0 < sizes.sample_budget:
                    ts = perf()
                    await stream.__anext__()
                    times.append(perf() - ts)
                seconds = perf() - t0
            finally:
                await stream.aclose()
        return {"seconds": seconds, "batches": len(times), "batches_per_s": len(times) / seconds, **latency(times)}

    return asyncio.run(timed())


def sample_methods(path: str, endpoints: Endpoints, kind: str, n: int, sizes: Sizes) -> dict[str, dict[str, Any]]:
    """Time every sampling method on the file at `path` (written by `fill_file`)."""
    got: dict[str, dict[str, Any]] = {}
    rng = np.random.default_rng(0)
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    try:
        expected = rb.sample(BATCH, np.random.default_rng(5))["obs"].copy()
        got["local, SWMR reader (as the server's reader)"] = time_batches(lambda: rb.sample(BATCH, rng), sizes)
    finally:
        rb.close()
    writer = ReplayBuffer.load_from(path, read_only=False, multiprocessing=True)
    try:
        got["local, writer's own buffer"] = time_batches(lambda: writer.sample(BATCH, rng), sizes)
    finally:
        writer.close()
    for readers in (1, 0):
        bind, read_bind = endpoints.pair()
        server = ServerProcess(ServerConfig(path=path, space=space_of(kind), capacity=n, bind=bind,
                                            read_bind=read_bind, num_readers=readers))
        try:
            with LearnerClient(bind, config=ClientConfig(endpoint=bind, timeout=30.0, local_reads=False)) as learner:
                wire = learner.sample(BATCH, seed=5)["obs"]
                if not np.array_equal(wire, expected):
                    raise AssertionError("LearnerClient.sample(seed=5) returned other rows than the local sample")
                name = ("wire, LearnerClient.sample" if readers else
                        "wire, num_readers=0 (the writer answers: no proxy hop)")
                got[name] = time_batches(lambda: learner.sample(BATCH), sizes)
                if readers:
                    batches = learner.batches(BATCH, prefetch=PREFETCH)
                    got[PIPELINED] = time_batches(functools.partial(next, batches), sizes)
                    batches.close()
                    got[ASYNC_PIPELINED] = time_async_batches(bind, sizes)
            if readers:
                got.update(same_host(bind, expected, sizes))
        finally:
            server.stop()
    bind, _ = endpoints.pair()
    sink = RawSink(bind, kind)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    dtype = ROW[kind][1]

    def raw_request() -> None:
        sock.send(b"S")
        if not sock.poll(30_000):
            raise TimeoutError("the raw sink did not answer within 30 s")
        frames = sock.recv_multipart(copy=False)
        np.frombuffer(frames[-1].buffer, dtype=dtype)  # what a client does with the rows

    try:
        sock.connect(bind)
        got["raw zmq, ready-made reply"] = time_batches(raw_request, sizes)
    finally:
        sock.close(0)
        ctx.term()
        sink.stop()
    return got


def same_host(endpoint: str, expected: np.ndarray, sizes: Sizes) -> dict[str, dict[str, Any]]:
    """The same learner on the file's host, drawing from its own view of the file."""
    got: dict[str, dict[str, Any]] = {}
    with LearnerClient(endpoint, config=ClientConfig(endpoint=endpoint, timeout=30.0)) as learner:
        if not np.array_equal(learner.sample(BATCH, seed=5)["obs"], expected):
            raise AssertionError("a same-host LearnerClient.sample(seed=5) returned other rows than the local sample")
        got[SAME_HOST] = time_batches(lambda: learner.sample(BATCH), sizes)
        batches = learner.batches(BATCH, prefetch=PREFETCH)
        got[SAME_HOST_PIPELINED] = time_batches(functools.partial(next, batches), sizes)
        batches.close()
        local = learner._state.local  # a benchmark checks the rows did not travel
        if local is None or not local.num_draws or not local.usable:
            raise AssertionError(f"the same-host learner did not draw from the file: {local and local.given_up}")
    got[SAME_HOST_ASYNC] = time_async_batches(endpoint, sizes, local_reads=True)
    return got


def run_sample(tmp: str, endpoints: Endpoints, sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in (SMALL, IMAGE):
        n = sizes.sample_rows[kind]
        path = os.path.join(tmp, f"sample-{kind}.h5")
        t0 = perf()
        fill_file(path, kind, n, sizes.episode_len)
        print(f"\n(wrote {n:,} {kind} rows for sampling in {perf() - t0:.1f} s)")
        try:
            got = sample_methods(path, endpoints, kind, n, sizes)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        local = got["local, SWMR reader (as the server's reader)"]["batches_per_s"]
        local_rw = got["local, writer's own buffer"]["batches_per_s"]
        raw = got["raw zmq, ready-made reply"]["batches_per_s"]
        table = []
        for name, m in got.items():
            m["rows_per_s"] = m["batches_per_s"] * BATCH
            m["mb_per_s"] = m["rows_per_s"] * row_bytes(kind) / 1e6
            m["vs_local"], m["vs_local_writer"], m["vs_raw"] = (m["batches_per_s"] / local,
                                                                m["batches_per_s"] / local_rw,
                                                                m["batches_per_s"] / raw)
            check = ""
            if name == PIPELINED and kind == IMAGE:
                m["target_met"] = m["vs_local"] >= 0.5
                check = f">=0.5x local {verdict(m['vs_local'], 0.5)}"
            elif name == PIPELINED:
                m["target_met"] = m["batches_per_s"] >= SMALL_BATCHES_TARGET
                check = f">={SMALL_BATCHES_TARGET:,}/s {verdict(m['batches_per_s'] / SMALL_BATCHES_TARGET, 1.0)}"
            elif name == ASYNC_PIPELINED:
                m["vs_blocking_batches"] = m["batches_per_s"] / got[PIPELINED]["batches_per_s"]
                m["target_met"] = m["vs_blocking_batches"] >= ASYNC_VS_BLOCKING_TARGET
                check = (f"{m['vs_blocking_batches']:.2f}x batches, >={ASYNC_VS_BLOCKING_TARGET}x "
                         f"{verdict(m['vs_blocking_batches'], ASYNC_VS_BLOCKING_TARGET)}")
            elif name in (SAME_HOST_PIPELINED, SAME_HOST_ASYNC):
                m["target_met"] = m["vs_local"] >= SAME_HOST_TARGET
                check = f">={SAME_HOST_TARGET}x local {verdict(m['vs_local'], SAME_HOST_TARGET)}"
            elif name.startswith(("wire", "same host")):
                check = "info"
            table.append([name, fmt(m["batches_per_s"]), fmt(m["rows_per_s"]), fmt(m["mb_per_s"]),
                          f"{m['p50_ms']:.3f}", f"{m['p99_ms']:.3f}", str(m["batches"]), f"{m['vs_local']:.2f}x",
                          f"{m['vs_local_writer']:.2f}x", f"{m['vs_raw']:.2f}x", check])
        print_table(f"2. sample({BATCH}) {kind} from {n:,} rows, 1 learner, at most {sizes.sample_batches} batches / "
                    f"{sizes.sample_budget:g} s per method",
                    ["method", "batch/s", "rows/s", "MB/s", "p50 ms", "p99 ms", "n", "vs local", "vs writer",
                     "vs raw", "target"], table)
        results[kind] = got
    return results


# ------------------------------------------------------------------------------ 3. RSS


def _rss_actor_main(endpoint: str, lengths: list[int], ready: Any, go: Any, out: Any) -> None:
    """Streams one episode per length (extend in 100-step pieces), reporting after each commit."""
    try:
        client = ActorClient(endpoint, timeout=120.0, name="bench-rss-actor")
        try:
            pool = make_rows(IMAGE, 200, seed=3)
            ready.set()
            go.wait(START_TIMEOUT)
            for length in lengths:
                t0 = perf()
                with client.segment() as seg:
                    for a in range(0, length, 100):
                        seg.extend({"obs": pool[a % 200 : a % 200 + min(100, length - a)]})
                out.put({"length": length, "seconds": perf() - t0})
        finally:
            client.close()
        out.put({"done": True})
    except BaseException:
        ready.set()
        out.put({"error": traceback.format_exc()})


def run_rss(tmp: str, endpoints: Endpoints, sizes: Sizes) -> dict[str, Any]:
    lengths = sizes.rss_lengths
    total = sum(lengths)
    path = os.path.join(tmp, "rss.h5")
    bind, read_bind = endpoints.pair()
    server = ServerProcess(ServerConfig(path=path, space=space_of(IMAGE), capacity=total, bind=bind,
                                        read_bind=read_bind))
    ctx = multiprocessing.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    actor = ctx.Process(target=_rss_actor_main, args=(bind, lengths, ready, go, out), name="bench-rss-actor",
                        daemon=True)
    rows: list[list[str]] = []
    try:
        actor.start()
        if not ready.wait(START_TIMEOUT):
            raise RuntimeError("the RSS actor did not start")
        pid = server.pid
        start = proc_status(pid)
        hwm_reset = reset_hwm(pid)
        start_after_reset = proc_status(pid)
        rows.append(["start (idle server)", "", "", f"{start['VmRSS']:.1f}",
                     f"{start['VmHWM']:.1f}" + (f" -> {start_after_reset['VmHWM']:.1f} (reset)" if hwm_reset else ""),
                     ""])
        marks: list[dict[str, Any]] = []
        peak_sampled = start["VmRSS"]
        go.set()
        deadline = time.monotonic() + 600
        while True:
            try:
                msg = out.get(timeout=0.02)
            except queue.Empty:
                peak_sampled = max(peak_sampled, proc_status(pid).get("VmRSS", 0.0))
                if time.monotonic() > deadline or not actor.is_alive():
                    raise RuntimeError("the RSS actor stopped without reporting") from None
                continue
            if "error" in msg:
                raise RuntimeError("the RSS actor failed:\n" + msg["error"])
            if msg.get("done"):
                break
            st = proc_status(pid)
            peak_sampled = max(peak_sampled, st["VmRSS"])
            marks.append({**msg, "rss_mb": st["VmRSS"], "hwm_mb": st["VmHWM"], "peak_sampled_mb": peak_sampled})
            mb = msg["length"] * row_bytes(IMAGE) / 1e6
            rows.append([f"after a {msg['length']:,}-step episode", f"{mb:.0f}", f"{mb / msg['seconds']:.0f}",
                         f"{st['VmRSS']:.1f}", f"{st['VmHWM']:.1f}", f"{peak_sampled:.1f}"])
        readers_mb = children_rss(pid)
        with LearnerClient(bind, timeout=30.0) as learner:
            info = learner.info()
        if info["length"] != total:
            raise AssertionError(f"server holds {info['length']} rows, expected {total}")
    finally:
        actor.join(10)
        if actor.is_alive():
            actor.kill()
            actor.join(5)
        server.stop()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    first = marks[0]
    peak = max(marks[-1]["hwm_mb"], peak_sampled)
    growth = peak - first["rss_mb"]
    r = {"lengths": lengths, "start": start, "hwm_reset": hwm_reset, "marks": marks, "peak_mb": peak,
         "growth_after_first_mb": growth, "growth_from_start_mb": peak - start["VmRSS"],
         "readers_rss_mb": readers_mb, "target_met": growth < 100}
    print_table(f"3. server RSS (writer process, pid {pid}): one actor streams image episodes of "
                f"{', '.join(f'{n:,}' for n in lengths)} steps ({total * row_bytes(IMAGE) / 1e6:.0f} MB)",
                ["point", "episode MB", "MB/s", "VmRSS MB", "VmHWM MB", "peak sampled MB"], rows)
    print(f"peak {peak:.1f} MB; growth from the end of the first episode {growth:+.1f} MB (target < 100 MB: "
          f"{'PASS' if r['target_met'] else 'MISS'}); from the idle start {r['growth_from_start_mb']:+.1f} MB; "
          f"reader process(es) VmRSS {readers_mb:.1f} MB at the end")
    return r


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, < 60 s: a smoke test")
    parser.add_argument("--only", choices=("ingest", "sample", "zmq", "rss"), help="run one section")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--modes", default=None, metavar="MODE,MODE,...",
                        help=f"the ingest modes to run (default: all but with --quick: {', '.join(MODES)})")
    parser.add_argument("--actors", default=None, metavar="N,N,...",
                        help="actor process counts for ingest (default 1,4,16; --quick: 1,4)")
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp",
                        help="tcp://127.0.0.1 on free ports (default) or ipc:// in the temporary directory")
    parser.add_argument("--profile", action="store_true",
                        help="ingest: run each server in this process under cProfile and print where its loop "
                             "spends its time (slower; its CPU%% and RSS columns then cover this whole process)")
    args = parser.parse_args(argv)
    try:
        actor_counts = [int(a) for a in (args.actors or ("1,4" if args.quick else "1,4,16")).split(",")]
    except ValueError:
        parser.error(f"--actors takes comma-separated counts, e.g. 1,4,16; got {args.actors!r}")
    if any(a < 1 for a in actor_counts):
        parser.error("--actors counts must be >= 1")
    sizes = QUICK if args.quick else FULL
    if args.modes:
        wanted = tuple(m.strip() for m in args.modes.split(",") if m.strip())
        unknown = [m for m in wanted if m not in MODES]
        if unknown:
            parser.error(f"unknown --modes {', '.join(unknown)}; choose from {', '.join(MODES)}")
        sizes = replace(sizes, modes=wanted)
    print(f"h5replay service benchmark ({'quick' if args.quick else 'full'}, {args.transport}, actors "
          f"{','.join(map(str, actor_counts))}): Python {sys.version.split()[0]}, numpy {np.__version__}, h5py "
          f"{h5py.version.version}, HDF5 {h5py.version.hdf5_version}, pyzmq {zmq.__version__}, libzmq "
          f"{zmq.zmq_version()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (other work on the "
          "machine shares the CPUs with every figure below)")
    results: dict[str, Any] = {"meta": {"quick": args.quick, "transport": args.transport, "actors": actor_counts,
                                        "sizes": asdict(sizes), "numpy": np.__version__, "h5py": h5py.version.version,
                                        "hdf5": h5py.version.hdf5_version, "pyzmq": zmq.__version__,
                                        "cpus": os.cpu_count(), "loadavg_start": os.getloadavg()}}
    started = perf()
    with tempfile.TemporaryDirectory(prefix="h5replay-svc-") as tmp:
        endpoints = Endpoints(tmp, args.transport)
        sections: dict[str, Callable[[], dict[str, Any]]] = {
            "ingest": lambda: run_ingest(tmp, endpoints, sizes, actor_counts, service=args.only != "zmq",
                                         raw=args.only != "ingest", profile=args.profile),
            "sample": lambda: run_sample(tmp, endpoints, sizes),
            "rss": lambda: run_rss(tmp, endpoints, sizes),
        }
        for name, run in sections.items():
            if args.only in (None, name) or (name == "ingest" and args.only == "zmq"):
                try:
                    results[name] = run()
                except Exception as exc:  # report it, and still run the other sections
                    traceback.print_exc()
                    print(f"\nsection {name} FAILED: {type(exc).__name__}: {exc}")
                    results[name] = {"error": f"{type(exc).__name__}: {exc}"}
    results["meta"]["seconds"] = perf() - started
    results["meta"]["loadavg_end"] = os.getloadavg()
    print(f"\ndone in {results['meta']['seconds']:.1f} s, load average now {os.getloadavg()[0]:.2f} "
          "(targets are informational; exit status is 0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
