"""Compressed leaves on real Atari frames: a zstd or lz4 image leaf against the same ring uncompressed.

    python -m venv .venv-frames && .venv-frames/bin/pip install -e '.[compression]' ale-py gymnasium
    .venv-frames/bin/python benchmarks/compressed.py            # about 75 s on 2 busy CPUs
    .venv-frames/bin/python benchmarks/compressed.py --quick    # tiny sizes, < 30 s: a smoke test
    .venv-frames/bin/python benchmarks/compressed.py --codec zstd --capacity 10000 --json /tmp/compressed.json

Run from the repository root. Never part of `make test` (pytest's testpaths is `tests`; this needs
gymnasium and ale-py, which the dev environment lacks).

Rows are DQN's: the 84x84x4 uint8 stack of the last four frames, 84x84 grey (gymnasium's
`ALE/Pong-v5` and `ALE/Breakout-v5`, a random policy, AtariPreprocessing + FrameStackObservation(4),
collected as benchmarks/frames.py does), in the space {"frame": int64, "obs": {"image": 84x84x4
uint8}}; "frame" is the stack's index among those collected, so every row read back is checked
bit for bit against the stack that was pushed. 5,000 stacks are collected per game (`--frames`);
episodes are 100 consecutive stacks of one game, and a ring of `--capacity` rows (default 20,000)
is filled exactly, cycling over the collected stacks.

Three configurations of the same workload, measured in the same run: the image leaf uncompressed
(the baseline), `compression={"obs/image": "zstd"}` at `compression_level` 3, and "lz4" (its fast
mode); default slots (1/8 of a raw row). Each figure is a ratio against uncompressed, with PASS/MISS
against its target (informational: PASS/MISS never changes the exit status):

1. bytes on disk per frame: the files' size once the ring is full and closed, / rows. Target: at
   least 4x fewer than uncompressed. The mean record size (what the codec made of a row) and the
   size of the file a server filled are printed beside it, for information.
2. ingest, rows/s. Local: one `ReplayBuffer.create(..., multiprocessing=True)` in this process (SWMR,
   as a served file is), per episode `open_segment_writer()`, one `extend` of the 100 rows and
   `commit_segment`, one final `flush` inside the timing. Target >= 0.8x uncompressed. Service: 4
   spawned actor processes (`--actors`), each one `ActorClient.push_episode` (waited for) per episode
   of its share, into one `ServerProcess` (a fresh one and a fresh file per case, tcp://127.0.0.1
   port 0), timed from a start barrier (every actor connected, its episodes built) to the last
   actor's last acknowledgement. Target >= 1.0x uncompressed.
3. local `sample(256)` from the full buffer of (2)'s local case, after its flush, in the writing process:
   batches/s. Target >= 0.5x uncompressed.
4. over the wire: `LearnerClient.sample(256)` in this process from the server (2)'s actors filled
   (its reader process answers; compressed records travel as stored and the learner decodes
   them): batches/s. Target >= 1.5x uncompressed.

Sampling runs for `--budget` seconds (default 2) after 3 untimed batches; every batch is checked
(every row's image against the stack its "frame" names) right after its call, outside the timing:
batches/s = batches / the seconds spent in the calls. A mismatch stops the run with an error (exit
status 1). Each figure is the median of 3 rounds (`--rounds`); a round measures every configuration
once, in an order that rotates from round to round, so a slow spell of this shared machine hits all
of them alike.

Everything lives in a temporary directory deleted at the end; servers and actor processes are
spawned and stopped in a `finally`. Loopback only. Nothing is fsync'd: the files sit in the page
cache, so (2) measures CPU and memory work, not a disk.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import queue
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import h5py
import numpy as np

try:
    import h5replay  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h5replay import codecs
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

STACK = (84, 84, 4)
STACK_BYTES = int(np.prod(STACK))
LEAF = "obs/image"
SPACE = DictSpace({
    "frame": BoxSpace(0, 1 << 40, (), np.int64),
    "obs": DictSpace({"image": BoxSpace(0, 255, STACK, np.uint8)}),
})
EPISODE_LEN = 100
BATCH = 256
WARMUP_BATCHES = 3
START_TIMEOUT = 120.0  # seconds for spawned processes to import, connect and reach the barrier
BASELINE = "uncompressed"
# Targets: how many times fewer bytes on disk, and rates as a ratio to uncompressed.
DISK_TARGET, LOCAL_INGEST_TARGET, SERVICE_INGEST_TARGET, LOCAL_SAMPLE_TARGET, WIRE_SAMPLE_TARGET = 4.0, 0.8, 1.0, 0.5, 1.5
perf = time.perf_counter  # CLOCK_MONOTONIC on Linux: comparable across processes


@dataclass(frozen=True)
class Sizes:
    frames_per_game: int  # stacks collected per game
    capacity: int  # rows of the ring, filled exactly: a multiple of EPISODE_LEN
    rounds: int
    budget: float  # seconds of sampling per measurement, checks included


FULL = Sizes(5_000, 20_000, 3, 2.0)
QUICK = Sizes(300, 1_000, 1, 0.3)


@dataclass(frozen=True)
class Config:
    """One way of storing the image leaf: its name in the tables and the storage keywords."""

    name: str
    storage_kwargs: dict[str, Any]


def configs(codec_names: list[str], zstd_level: int) -> list[Config]:
    made = [Config(BASELINE, {})]
    for name in codec_names:
        if name == "zstd":
            made.append(Config(f"zstd {zstd_level}", {"compression": {LEAF: "zstd"},
                                                     "compression_level": {LEAF: zstd_level}}))
        else:
            made.append(Config("lz4", {"compression": {LEAF: "lz4"}}))
    return made


# ------------------------------------------------------------------------------ frames


def stacks_of(game: str, count: int, seed: int) -> np.ndarray:
    """`count` 84x84x4 stacks of `game` under a random policy, preprocessed as DQN does (the
    collection of benchmarks/frames.py, this script's neighbour)."""
    from frames import frames_of

    return frames_of(game, count, seed)[1]


def collect(games: list[str], per_game: int, seed: int) -> np.ndarray:
    """The stacks of every game one after another, each game's cut to whole episodes (an episode
    never spans two games)."""
    usable = per_game // EPISODE_LEN * EPISODE_LEN
    return np.concatenate([stacks_of(game, per_game, seed)[:usable] for game in games])


def episode_starts(capacity: int, num_stacks: int) -> list[int]:
    """The first stack of each episode that fills the ring: the collected stacks, in episodes, cycled."""
    pieces = num_stacks // EPISODE_LEN
    return [(k % pieces) * EPISODE_LEN for k in range(capacity // EPISODE_LEN)]


def episode(stacks: np.ndarray, start: int) -> dict[str, Any]:
    """The episode of stacks[start : start + EPISODE_LEN] (views of `stacks`, no copy)."""
    return {"frame": np.arange(start, start + EPISODE_LEN, dtype=np.int64),
            "obs": {"image": stacks[start : start + EPISODE_LEN]}}


def check_batch(batch: dict[str, Any], stacks: np.ndarray, where: str) -> None:
    """Every row's image is, bit for bit, the stack its "frame" names."""
    frames, images = np.asarray(batch["frame"]), np.asarray(batch["obs"]["image"])
    if images.shape != (len(frames), *STACK) or images.dtype != np.uint8:
        raise AssertionError(f"{where}: a batch of {images.shape} {images.dtype} images, expected "
                             f"({len(frames)}, {', '.join(map(str, STACK))}) uint8")
    if frames.min() < 0 or frames.max() >= len(stacks):
        raise AssertionError(f"{where}: frame ids {int(frames.min())}..{int(frames.max())} were never pushed")
    if not np.array_equal(images, stacks[frames]):
        bad = [int(f) for f, img in zip(frames, images) if not np.array_equal(img, stacks[f])]
        raise AssertionError(f"{where}: {len(bad)} of {len(frames)} rows are not the stacks pushed "
                             f"(frames {bad[:5]}{'...' if len(bad) > 5 else ''})")


# ------------------------------------------------------------------------------ measurements


def time_samples(draw: Any, stacks: np.ndarray, budget: float, where: str) -> dict[str, float]:
    """`draw()` (a 256-row batch) for `budget` seconds after a few untimed ones; every batch is
    checked after its call, outside the timing."""
    for _ in range(WARMUP_BATCHES):
        check_batch(draw(), stacks, where)
    times: list[float] = []
    t0 = perf()
    while perf() - t0 < budget or len(times) < 5:
        ts = perf()
        batch = draw()
        times.append(perf() - ts)
        check_batch(batch, stacks, where)
    t = np.asarray(times)
    return {"batches_per_s": len(t) / float(t.sum()), "batches": len(t),
            "p50_ms": float(np.percentile(t, 50)) * 1e3, "p99_ms": float(np.percentile(t, 99)) * 1e3}


def files_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, name)) for name in os.listdir(directory))


def run_local(directory: str, config: Config, stacks: np.ndarray, starts: list[int], capacity: int,
              budget: float) -> dict[str, float]:
    """(2, local) ingest into a new buffer, (3) sample it, then (1) the closed file's bytes."""
    os.makedirs(directory)
    rb = ReplayBuffer.create(SPACE, capacity, os.path.join(directory, "local.h5"), multiprocessing=True,
                             **config.storage_kwargs)
    try:
        episodes = [episode(stacks, s) for s in starts]
        t0 = perf()
        for batch in episodes:
            writer = rb.open_segment_writer()
            writer.extend(batch)
            rb.commit_segment(writer)
        rb.flush()
        seconds = perf() - t0
        if len(rb) != capacity:
            raise AssertionError(f"{config.name}: the local buffer holds {len(rb)} rows, expected {capacity}")
        rng = np.random.default_rng(0)
        sampled = time_samples(lambda: rb.sample(BATCH, rng), stacks, budget, f"{config.name}, local sample")
    finally:
        rb.close()
    size = files_bytes(directory)
    shutil.rmtree(directory)
    return {"ingest_rows_per_s": capacity / seconds, "bytes_per_frame": size / capacity,
            **{f"sample_{k}": v for k, v in sampled.items()}}


def _actor_main(inbox: Any, barrier: Any, out: Any) -> None:
    """A spawned actor: for each task (endpoint, stacks file, episode starts), one ActorClient
    pushes those episodes, each push waited for, then reports; until it gets None."""
    stacks: dict[str, np.ndarray] = {}
    out.put({"ready": True})
    while True:
        task = inbox.get()
        if task is None:
            return
        endpoint, path, starts = task
        try:
            source = stacks.get(path)
            if source is None:
                source = stacks[path] = np.load(path, mmap_mode="r")
            # In this process's memory before the clock starts: no page faults in the timing.
            pieces = {s: np.array(source[s : s + EPISODE_LEN]) for s in set(starts)}
            episodes = [{"frame": np.arange(s, s + EPISODE_LEN, dtype=np.int64), "obs": {"image": pieces[s]}}
                        for s in starts]
            with ActorClient(endpoint, timeout=60.0, name=f"bench-actor-{os.getpid()}") as client:
                barrier.wait(START_TIMEOUT)
                t0 = perf()
                for batch in episodes:
                    client.push_episode(batch)
                t1 = perf()
            out.put({"t0": t0, "t1": t1, "rows": len(starts) * EPISODE_LEN, "episodes": len(starts)})
        except BaseException:
            barrier.abort()
            out.put({"error": traceback.format_exc()})


class Actors:
    """`n` spawned actor processes, reused by every service case (spawning them costs seconds);
    a start barrier of `n` + this process releases them together."""

    def __init__(self, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.n = n
        self.barrier, self.out = ctx.Barrier(n + 1), ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(n)]
        self.procs = [ctx.Process(target=_actor_main, args=(inbox, self.barrier, self.out), name=f"bench-actor-{i}",
                                  daemon=True) for i, inbox in enumerate(self.inboxes)]
        for proc in self.procs:
            proc.start()
        try:  # every actor's imports done: cases must not share the CPUs with start-up work
            self._collect(n, "started")
        except BaseException:
            self.close()
            raise

    def _collect(self, n: int, what: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []
        deadline = time.monotonic() + START_TIMEOUT + 600
        while len(got) < n:
            try:
                got.append(self.out.get(timeout=1.0))
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in self.procs):
                    raise RuntimeError(f"only {len(got)} of {n} actor processes {what}") from None
                continue
            if "error" in got[-1]:
                raise RuntimeError("an actor failed:\n" + got[-1]["error"])
        return got

    def run(self, endpoint: str, path: str, starts: list[int]) -> dict[str, float]:
        """Share `starts` out (episode k to actor k % n), push, and return rows and seconds from
        the first actor's start to the last one's final acknowledgement."""
        for i, inbox in enumerate(self.inboxes):
            inbox.put((endpoint, path, starts[i :: self.n]))
        with contextlib.suppress(threading.BrokenBarrierError):  # an actor failed: its error is queued
            self.barrier.wait(START_TIMEOUT)
        results = self._collect(self.n, "reported")
        seconds = max(r["t1"] for r in results) - min(r["t0"] for r in results)
        return {"rows": sum(r["rows"] for r in results), "episodes": sum(r["episodes"] for r in results),
                "seconds": seconds}

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


def run_service(directory: str, config: Config, stacks: np.ndarray, stacks_path: str, starts: list[int],
                capacity: int, budget: float, actors: Actors) -> dict[str, float]:
    """(2, service) the actors fill a new server's ring, (4) the learner samples it, then the
    served file's bytes (information)."""
    os.makedirs(directory)
    server = ServerProcess(ServerConfig(path=os.path.join(directory, "served.h5"), space=SPACE, capacity=capacity,
                                        bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0",
                                        storage_kwargs=dict(config.storage_kwargs)), timeout=60.0)
    try:
        pushed = actors.run(server.endpoint, stacks_path, starts)
        with LearnerClient(server.endpoint, timeout=30.0) as learner:
            info = learner.info()
            if info["length"] != capacity or info["commits"] != len(starts):
                raise AssertionError(f"{config.name}: the server holds {info['length']} rows in {info['commits']} "
                                     f"commits; the actors pushed {pushed['rows']} rows in {pushed['episodes']}")
            sampled = time_samples(lambda: learner.sample(BATCH), stacks, budget, f"{config.name}, LearnerClient.sample")
    finally:
        server.stop()
    size = files_bytes(directory)
    shutil.rmtree(directory)
    return {"service_rows_per_s": pushed["rows"] / pushed["seconds"], "served_bytes_per_frame": size / capacity,
            **{f"wire_{k}": v for k, v in sampled.items()}}


def mean_record_bytes(config: Config, stacks: np.ndarray) -> float:
    """What the codec makes of a row (at most 2,000 of them), before it goes into a slot."""
    if "compression" not in config.storage_kwargs:
        return float(STACK_BYTES)
    chosen = codecs.codec(config.storage_kwargs["compression"][LEAF],
                          config.storage_kwargs.get("compression_level", {}).get(LEAF), LEAF)
    step = max(1, len(stacks) // 2_000)
    return float(np.mean([len(record) for record, _ in codecs.encode_rows(stacks[::step], chosen)]))


# ------------------------------------------------------------------------------ report


def fmt(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    print(f"\n{title}")
    line = "  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths)))
    print(line + "\n" + "-" * len(line))
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    sys.stdout.flush()


def report(results: dict[str, dict[str, Any]], sizes: Sizes, num_actors: int) -> None:
    """The four figures, each a median over rounds and a ratio to uncompressed, with its target."""
    base = results[BASELINE]["median"]
    figures = [  # key, title, unit, target (None: information), bigger is better
        ("bytes_per_frame", f"1. bytes on disk per frame (the {sizes.capacity:,}-row ring full, local file closed: "
         "size / rows)", "bytes", DISK_TARGET, False),
        ("ingest_rows_per_s", "2a. local ingest: ReplayBuffer(multiprocessing=True), extend + commit_segment of "
         f"{EPISODE_LEN}-step episodes", "rows/s", LOCAL_INGEST_TARGET, True),
        ("service_rows_per_s", f"2b. service ingest: {num_actors} actor processes, ActorClient.push_episode "
         "(waited for) into one ServerProcess", "rows/s", SERVICE_INGEST_TARGET, True),
        ("sample_batches_per_s", f"3. local sample({BATCH}) from the full buffer after flush (writer's own)",
         "batch/s", LOCAL_SAMPLE_TARGET, True),
        ("wire_batches_per_s", f"4. wire: LearnerClient.sample({BATCH}) from the server of 2b (tcp loopback)",
         "batch/s", WIRE_SAMPLE_TARGET, True),
    ]
    for key, title, unit, target, bigger in figures:
        rows = []
        for name, got in results.items():
            value, rounds = got["median"][key], [r[key] for r in got["rounds"]]
            ratio = value / base[key] if bigger else base[key] / value
            got.setdefault("vs_uncompressed", {})[key] = ratio
            check = ""
            if name != BASELINE:
                met = ratio >= target
                got.setdefault("target_met", {})[key] = met
                check = f">={target:g}x{' fewer' if not bigger else ''} {'PASS' if met else 'MISS'}"
            extra: list[str] = []
            if key == "bytes_per_frame":
                extra = [fmt(got["median"]["served_bytes_per_frame"]), fmt(got["record_bytes"]),
                         f"{STACK_BYTES / got['record_bytes']:.1f}x"]
            elif key.endswith("batches_per_s"):
                prefix = key.removesuffix("batches_per_s")
                extra = [f"{got['median'][prefix + 'p50_ms']:.2f}", f"{got['median'][prefix + 'p99_ms']:.2f}",
                         f"{value * BATCH * STACK_BYTES / 1e6:.0f}"]
            else:
                extra = [f"{value * STACK_BYTES / 1e6:.0f}"]
            shown = f"{ratio:.2f}x" + (" fewer" if not bigger and name != BASELINE else "")
            rows.append([name, fmt(value), *extra, " / ".join(fmt(v) for v in rounds), shown, check])
        if key == "bytes_per_frame":
            header = ["config", unit, "served file", "mean record", "codec ratio"]
        elif key.endswith("batches_per_s"):
            header = ["config", unit, "p50 ms", "p99 ms", "raw MB/s"]
        else:
            header = ["config", unit, "raw MB/s"]
        print_table(title, [*header, "rounds", "vs uncompressed", "target"], rows)


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke test")
    parser.add_argument("--codec", default="zstd,lz4", help="codecs against uncompressed: zstd, lz4 or zstd,lz4")
    parser.add_argument("--zstd-level", type=int, default=3, help="zstd's compression_level (default 3)")
    parser.add_argument("--capacity", type=int, help=f"ring rows, a multiple of {EPISODE_LEN} (default "
                        f"{FULL.capacity:,}; --quick {QUICK.capacity:,})")
    parser.add_argument("--frames", type=int, help=f"stacks collected per game (default {FULL.frames_per_game:,}; "
                        f"--quick {QUICK.frames_per_game})")
    parser.add_argument("--games", default="Pong,Breakout", help="ALE games, comma-separated")
    parser.add_argument("--rounds", type=int, help="rounds, the median reported (default 3; --quick 1)")
    parser.add_argument("--budget", type=float, help="seconds of sampling per measurement (default 2; --quick 0.3)")
    parser.add_argument("--actors", type=int, default=4, help="actor processes of the service ingest (default 4)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    sizes = Sizes(args.frames or sizes.frames_per_game, args.capacity or sizes.capacity, args.rounds or sizes.rounds,
                  args.budget if args.budget is not None else sizes.budget)
    codec_names = [c.strip() for c in args.codec.split(",") if c.strip()]
    if not codec_names or any(c not in ("zstd", "lz4") for c in codec_names) or len(set(codec_names)) < len(codec_names):
        parser.error(f"--codec takes zstd, lz4 or zstd,lz4; got {args.codec!r}")
    if sizes.capacity < EPISODE_LEN or sizes.capacity % EPISODE_LEN:
        parser.error(f"--capacity must be a positive multiple of {EPISODE_LEN}, got {sizes.capacity}")
    if sizes.frames_per_game < EPISODE_LEN:
        parser.error(f"--frames must be at least {EPISODE_LEN} (one episode)")
    if sizes.rounds < 1 or args.actors < 1 or sizes.budget <= 0:
        parser.error("--rounds and --actors must be >= 1, --budget > 0")
    try:
        import ale_py  # noqa: F401
        import gymnasium  # noqa: F401
        import lz4.block  # noqa: F401
        import zstandard  # noqa: F401
    except ImportError as exc:
        print(f"needs the optional packages ({exc}); see the module docstring", file=sys.stderr)
        return 2
    games = [g.strip() for g in args.games.split(",") if g.strip()]
    cases = configs(codec_names, args.zstd_level)
    print(f"h5replay compressed-leaf benchmark ({'quick' if args.quick else 'full'}): {', '.join(c.name for c in cases)}; "
          f"Python {sys.version.split()[0]}, numpy {np.__version__}, h5py {h5py.version.version}, HDF5 "
          f"{h5py.version.hdf5_version}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")
    started = perf()
    stacks = collect(games, sizes.frames_per_game, args.seed)
    starts = episode_starts(sizes.capacity, len(stacks))
    print(f"collected {len(stacks):,} stacks of {', '.join(games)} in {perf() - started:.1f} s; a ring of "
          f"{sizes.capacity:,} rows ({sizes.capacity * STACK_BYTES / 1e6:.0f} MB raw) = {len(starts)} episodes of "
          f"{EPISODE_LEN}; {sizes.rounds} round(s), sampling {sizes.budget:g} s per measurement")
    sys.stdout.flush()
    results: dict[str, dict[str, Any]] = {c.name: {"rounds": [], "record_bytes": mean_record_bytes(c, stacks)}
                                          for c in cases}
    with tempfile.TemporaryDirectory(prefix="h5replay-compressed-") as tmp:
        stacks_path = os.path.join(tmp, "stacks.npy")
        np.save(stacks_path, stacks)
        warm = starts[: min(len(starts), 3)]
        for c in cases:  # warm-up, untimed: codec contexts, allocators, the page cache
            run_local(os.path.join(tmp, f"warm-{c.name}"), c, stacks, warm, len(warm) * EPISODE_LEN, 0.05)
        actors = Actors(args.actors)
        try:
            for r in range(sizes.rounds):
                for c in cases[r % len(cases) :] + cases[: r % len(cases)]:
                    t0 = perf()
                    where = os.path.join(tmp, f"r{r}-{c.name.replace(' ', '')}")
                    got = run_local(where + "-local", c, stacks, starts, sizes.capacity, sizes.budget)
                    got |= run_service(where + "-served", c, stacks, stacks_path, starts, sizes.capacity, sizes.budget,
                                       actors)
                    results[c.name]["rounds"].append(got)
                    print(f"  round {r + 1}, {c.name}: {perf() - t0:.1f} s (local ingest {fmt(got['ingest_rows_per_s'])} "
                          f"rows/s, service {fmt(got['service_rows_per_s'])} rows/s, sample "
                          f"{fmt(got['sample_batches_per_s'])}/s, wire {fmt(got['wire_batches_per_s'])}/s; every "
                          f"sampled row checked)")
                    sys.stdout.flush()
        finally:
            actors.close()
    for got in results.values():
        got["median"] = {k: statistics.median(r[k] for r in got["rounds"]) for k in got["rounds"][0]}
    report(results, sizes, args.actors)
    seconds = perf() - started
    print(f"\ndone in {seconds:.1f} s, load average now {os.getloadavg()[0]:.2f}; every row sampled matched the stack "
          "pushed (targets are informational; exit status is 0)")
    if args.json:
        meta = {"quick": args.quick, "sizes": asdict(sizes), "games": games, "actors": args.actors, "seconds": seconds,
                "numpy": np.__version__, "h5py": h5py.version.version, "hdf5": h5py.version.hdf5_version}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
