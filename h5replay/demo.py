"""`h5replay demo`: a server, actor processes and a learner on an embedded default, end to end.

Actors stream episodes of random length whose rows say who wrote them (actor, episode, step);
the learner samples rows and windows while they write and checks every row it gets against that
encoding. At the end the server is stopped with SIGTERM and the file is reopened and checked:
every acknowledged episode is there once, whole, in order. Loopback only.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from typing import Any

import numpy as np

from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, TextSpace

__all__ = ["DEMO_SPACE", "run_demo"]

DEMO_SPACE = DictSpace(
    {
        "obs": {"image": BoxSpace(0, 255, (32, 32, 3), np.uint8), "state": BoxSpace(-np.inf, np.inf, (8,))},
        "action": BoxSpace(-1, 1, (2,)),
        "reward": BoxSpace(-np.inf, np.inf, ()),
        "done": BinarySpace(),
        "id": BoxSpace(0, 2**31 - 1, (3,), np.int64),  # actor, episode, step
        "note": TextSpace(16),
    }
)


def demo_episode(actor: int, episode: int, length: int) -> dict[str, Any]:
    """An episode whose every field is a function of (actor, episode, step), so rows can be checked."""
    steps = np.arange(length)
    marker = (actor * 31 + episode * 7 + steps) % 256
    state = np.zeros((length, 8), np.float32)
    state[:, 0], state[:, 1], state[:, 2] = actor, episode, steps
    return {
        "obs": {"image": np.broadcast_to(marker[:, None, None, None], (length, 32, 32, 3)).astype(np.uint8), "state": state},
        "action": np.tanh(state[:, :2] / 100),
        "reward": (steps == length - 1).astype(np.float32),
        "done": steps == length - 1,
        "id": np.stack([np.full(length, actor), np.full(length, episode), steps], axis=1).astype(np.int64),
        "note": np.array([f"a{actor}e{episode}s{s}"[:16] for s in steps], dtype=object),
    }


def check_rows(batch: dict[str, Any]) -> int:
    """How many rows of a (flat) batch do not match what their id says they should be."""
    ids = batch["id"]
    marker = (ids[:, 0] * 31 + ids[:, 1] * 7 + ids[:, 2]) % 256
    bad = (batch["obs"]["image"][:, 0, 0, 0] != marker) | (batch["obs"]["state"][:, 2] != ids[:, 2])
    notes = np.array([f"a{a}e{e}s{s}"[:16] for a, e, s in ids], dtype=object)
    bad |= batch["note"] != notes
    return int(bad.sum())


def _actor(endpoint: str, actor: int, episodes: int, seed: int, out: Any, committed_count: Any) -> None:
    from h5replay.client import ActorClient

    rng = np.random.default_rng(seed)
    committed = []
    with ActorClient(endpoint, timeout=30, name=f"demo-actor-{actor}") as client:
        for episode in range(episodes):
            length = int(rng.integers(20, 300))
            data = demo_episode(actor, episode, length)
            with client.segment() as seg:
                for t in range(length):  # step by step, as an environment loop would
                    seg.append({
                        "obs": {"image": data["obs"]["image"][t], "state": data["obs"]["state"][t]},
                        "action": data["action"][t], "reward": data["reward"][t], "done": data["done"][t],
                        "id": data["id"][t], "note": data["note"][t],
                    })
            committed.append((actor, episode, length))
            with committed_count.get_lock():
                committed_count.value += 1
    out.put(committed)


def _learner(endpoint: str, stop: Any, out: Any) -> None:
    from h5replay.client import LearnerClient
    from h5replay.errors import NotEnoughDataError

    batches = rows = bad = windows_bad = 0
    latencies = []
    with LearnerClient(endpoint, timeout=30, name="demo-learner") as learner:
        while not stop.is_set():
            try:
                started = time.perf_counter()
                batch = learner.sample(256)
                latencies.append(time.perf_counter() - started)
                seqs = learner.sample_sequences(16, 8)
            except NotEnoughDataError:
                time.sleep(0.05)
                continue
            batches += 1
            rows += 256
            bad += check_rows(batch)
            ids = seqs["id"]
            windows_bad += int(np.sum(~((ids[:, :, 0] == ids[:, :1, 0]) & (ids[:, :, 1] == ids[:, :1, 1])
                                        & (np.diff(ids[:, :, 2], axis=1, prepend=ids[:, :1, 2] - 1) == 1)).all(axis=1)))
    out.put((batches, rows, bad, windows_bad, latencies))


def _wait_for_actors(results: Any, actors: int, committed_count: Any, total: int) -> list[tuple[int, int, int]]:
    """Every actor's committed episodes, showing how many are committed meanwhile (on a terminal)."""
    import queue

    from h5replay.progress import Progress

    progress = Progress("  ingest  ", "episodes", stream=sys.stdout)
    committed: list[tuple[int, int, int]] = []
    finished = 0
    deadline = time.monotonic() + 600
    while finished < actors:
        try:
            committed.extend(results.get(timeout=0.1))
            finished += 1
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TimeoutError("the demo's actors did not finish within 600 s") from None
        progress(min(committed_count.value, total) if finished < actors else total, total)
    return committed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_demo(num_actors: int = 4, episodes_per_actor: int = 40, directory: str | None = None) -> int:
    """Run the demo; returns 0 when every check passed. Without `directory`, the file lives in a
    temporary directory that is removed at the end."""
    if directory is not None:
        return _run_demo(num_actors, episodes_per_actor, directory)
    with tempfile.TemporaryDirectory(prefix="h5replay-demo-") as workdir:
        code = _run_demo(num_actors, episodes_per_actor, workdir)
    print(f"(removed {workdir}; `h5replay demo --dir DIR` keeps the file)")
    return code


def _run_demo(num_actors: int, episodes_per_actor: int, workdir: str) -> int:
    from h5replay.config import ServerConfig
    from h5replay.server import ServerProcess
    from h5replay.storage.inspect import describe_file, format_description
    from h5replay.storage.replay.buffer import ReplayBuffer

    path = os.path.join(workdir, "demo.h5")
    if os.path.exists(path):
        os.unlink(path)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    config = ServerConfig(path=path, space=DEMO_SPACE, capacity=100_000, bind=endpoint,
                          read_bind=f"tcp://127.0.0.1:{_free_port()}", num_readers=1)
    print(f"h5replay demo: {num_actors} actors x {episodes_per_actor} episodes of 20..300 steps into {path}")
    ctx = mp.get_context("spawn")
    results, learned, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    server = ServerProcess(config)
    try:
        print(f"  server ready on {endpoint} (pid {server.pid})")
        started = time.perf_counter()
        committed_count = ctx.Value("q", 0)
        actors = [ctx.Process(target=_actor, args=(endpoint, a, episodes_per_actor, a, results, committed_count))
                  for a in range(num_actors)]
        learner = ctx.Process(target=_learner, args=(endpoint, stop, learned))
        for proc in [*actors, learner]:
            proc.start()
        committed = _wait_for_actors(results, len(actors), committed_count, num_actors * episodes_per_actor)
        ingest_seconds = time.perf_counter() - started
        stop.set()
        batches, rows_read, bad, windows_bad, latencies = learned.get(timeout=60)
        for proc in [*actors, learner]:
            proc.join(30)
        exit_code = server.stop()
    finally:
        server.kill()
    total_rows = sum(n for _, _, n in committed)
    row_bytes = sum(leaf.row_bytes for _, leaf in DEMO_SPACE.leaves())
    print(f"  ingest   {len(committed)} episodes, {total_rows} rows in {ingest_seconds:.1f} s: "
          f"{total_rows / ingest_seconds:,.0f} rows/s, {total_rows * row_bytes / ingest_seconds / 1e6:.1f} MB/s")
    print(f"           (each actor appends one step at a time, as an environment loop does, and waits for each "
          f"episode's commit; rows of {row_bytes:,} bytes, a 32x32x3 image and small fields. Whole episodes in "
          "flight go several times faster: python benchmarks/service.py)")
    lat = np.array(latencies or [0.0]) * 1000
    print(f"  learner  {batches} batches of 256 while ingesting ({batches / ingest_seconds:.0f}/s), "
          f"p50 {np.percentile(lat, 50):.2f} ms, p99 {np.percentile(lat, 99):.2f} ms; "
          f"{bad} bad rows of {rows_read}, {windows_bad} windows crossing an episode")
    print(f"  server   exited with code {exit_code} after SIGTERM")

    with ReplayBuffer.load_from(path) as buffer:
        segments = buffer.get_segments()
        found = {}
        for start, length in segments:
            ids = buffer.get_at(slice(start, start + length))["id"]
            found[(int(ids[0, 0]), int(ids[0, 1]))] = (length, bool(np.all(ids[:, 2] == np.arange(length))))
    missing = [(a, e) for a, e, n in committed if found.get((a, e)) != (n, True)]
    print(f"  reopened file: {len(segments)} episodes, {len(missing)} of the {len(committed)} acknowledged "
          "episodes missing or damaged")
    print("\n" + format_description(describe_file(path)))
    ok = exit_code == 0 and bad == 0 and windows_bad == 0 and not missing and len(segments) == len(committed)
    print(f"\nh5replay demo: {'OK' if ok else 'FAILED'}")
    if ok:
        print(NEXT_STEPS)
    return 0 if ok else 1


NEXT_STEPS = """
Next, with the command-line tool in .venv/bin (or `source .venv/bin/activate`):
  h5replay space gym CartPole-v1 > cartpole.json          # the rows of an environment
  h5replay serve replay.h5 --space cartpole.json --capacity 100000
  h5replay actor tcp://127.0.0.1:5555 --env CartPole-v1   # in another terminal; as many as you like
  h5replay learner tcp://127.0.0.1:5555 --seconds 10      # samples and says what it sees
  h5replay stats tcp://127.0.0.1:5555                     # live figures
The README's quick start has the same in Python."""
