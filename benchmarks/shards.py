"""Shards on one machine: ingest and sampling with 2 servers against 1, in the same run.

Run from the repository root (not collected by pytest)::

    .venv/bin/python benchmarks/shards.py            # about 2 minutes
    .venv/bin/python benchmarks/shards.py --quick    # a smoke test, < 40 s

1. ingest: episodes of 100 rows of {"obs": 7 x float32} (one `push_episode` each: one message, one
   round trip, a commit), written by A actor processes (`--actors`, default 4 and 8), each an
   `ActorClient(endpoints=[...])`, for a fixed time. Against 1 shard all actors write to it; against
   2, the actors' names are picked so that half have each shard as home. Rows/s from a start
   barrier to the end of the time, and the CPU seconds the servers' processes (writers and readers)
   and the actors used, which say what bounds the figure: on 2 cores, the actors and the servers
   share the same 2 CPUs, so a second writer only helps as far as one writer's loop was the limit.
2. sample: `LearnerClient(endpoints=[...]).sample(256)` from 200,000 small rows held by 1 shard, or
   100,000 on each of 2 (written locally first), batches/s and p50/p99 of one learner, and of 2
   learner processes at once; and over 2 shards one learner through `LearnerClient` against one
   through `AsyncLearnerClient(endpoints=[...])` (the same routing on asyncio), as a ratio.

Each case runs `--repeat` times (default 3), 1 and 2 shards alternating; the table shows medians.
The load average is printed before and after: the machine is shared, read the ratios. Everything
lives in a temporary directory deleted at the end; every server and process is stopped.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

from h5replay.client import ActorClient, LearnerClient
from h5replay.client._shards import home_shard
from h5replay.config import ClientConfig, ServerConfig
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, DictSpace, ReplayBuffer

SPACE = DictSpace({"obs": BoxSpace(-np.inf, np.inf, (7,), np.float32)})
EPISODE = 100
SPAWN = mp.get_context("spawn")
_TICK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and of its children (the readers), from /proc."""
    total = 0.0
    for entry in [str(pid), *_children(pid)]:
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK
        except OSError:
            pass
    return total


def _children(pid: int) -> list[str]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == pid:
                        out.append(entry)
            except OSError:
                pass
    return out


def names_for(num_actors: int, num_shards: int) -> list[str]:
    """Actor names whose home shards are spread evenly over the shards."""
    names, want = [], [num_actors // num_shards + (k < num_actors % num_shards) for k in range(num_shards)]
    i = 0
    while len(names) < num_actors:
        name, i = f"bench-actor-{i}", i + 1
        k = home_shard(name, num_shards)
        if want[k]:
            want[k] -= 1
            names.append(name)
    return names


def start_servers(tmp: str, num_shards: int, tag: str, fill: int = 0) -> list[ServerProcess]:
    servers = []
    try:
        for k in range(num_shards):
            path = os.path.join(tmp, f"{tag}-{k}.h5")
            if fill:
                fill_file(path, fill)
            config = ServerConfig(path=path, space=SPACE, capacity=None if fill else 10_000_000,
                                  bind=f"tcp://127.0.0.1:{free_port()}", read_bind=f"tcp://127.0.0.1:{free_port()}")
            if fill:
                config = config.replace(space=None)
            servers.append(ServerProcess(config, timeout=60))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def fill_file(path: str, n: int) -> None:
    rb = ReplayBuffer.create(SPACE, n, path, multiprocessing=True)
    try:
        rows = np.random.default_rng(0).standard_normal((n, 7), dtype=np.float32)
        for j in range(0, n, EPISODE):
            rb.extend({"obs": rows[j : j + EPISODE]})
            rb.end_episode()
        rb.flush()
    finally:
        rb.close()


def _actor_main(endpoints: list[str], name: str, seconds: float, barrier: Any, out: Any) -> None:
    rows = {"obs": np.random.default_rng(1).standard_normal((EPISODE, 7), dtype=np.float32)}
    with ActorClient(config=ClientConfig(timeout=30, name=name), endpoints=endpoints) as client:
        client.push_episode(rows)  # warm
        barrier.wait(60)
        t0 = time.perf_counter()
        cpu0 = time.process_time()
        episodes = 0
        while time.perf_counter() - t0 < seconds:
            client.push_episode(rows)
            episodes += 1
        out.put((episodes * EPISODE, time.perf_counter() - t0, time.process_time() - cpu0, client.shard))


def ingest(tmp: str, num_shards: int, num_actors: int, seconds: float, tag: str) -> dict[str, Any]:
    servers = start_servers(tmp, num_shards, tag)
    procs = []
    try:
        endpoints = [s.endpoint for s in servers]
        barrier, out = SPAWN.Barrier(num_actors + 1), SPAWN.Queue()
        for name in names_for(num_actors, num_shards):
            procs.append(SPAWN.Process(target=_actor_main, args=(endpoints, name, seconds, barrier, out)))
            procs[-1].start()
        barrier.wait(120)
        cpu0 = [cpu_seconds(s.pid) for s in servers]
        t0 = time.perf_counter()
        results = [out.get(timeout=seconds + 60) for _ in procs]
        wall = time.perf_counter() - t0
        server_cpu = sum(cpu_seconds(s.pid) - c for s, c in zip(servers, cpu0))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for server in servers:
            server.stop()
    rows = sum(r[0] for r in results)
    return {"rows_per_s": rows / wall, "server_cpu_per_s": server_cpu / wall,
            "actor_cpu_per_s": sum(r[2] for r in results) / wall, "homes": sorted(r[3] for r in results)}


def _learner_main(endpoints: list[str], seconds: float, barrier: Any, out: Any) -> None:
    with LearnerClient(endpoints=endpoints, timeout=30) as learner:
        for _ in range(10):
            learner.sample(256)
        barrier.wait(60)
        times = []
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ts = time.perf_counter()
            learner.sample(256)
            times.append(time.perf_counter() - ts)
        out.put((len(times) / (time.perf_counter() - t0), times))


def _async_learner_main(endpoints: list[str], seconds: float, barrier: Any, out: Any) -> None:
    """`_learner_main` through AsyncLearnerClient(endpoints=): one sample awaited at a time."""
    import asyncio

    from h5replay.client.aio import AsyncLearnerClient

    async def run() -> tuple[float, list[float]]:
        async with AsyncLearnerClient(endpoints=endpoints, timeout=30) as learner:
            for _ in range(10):
                await learner.sample(256)
            await asyncio.to_thread(barrier.wait, 60)
            times = []
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                ts = time.perf_counter()
                await learner.sample(256)
                times.append(time.perf_counter() - ts)
            return len(times) / (time.perf_counter() - t0), times

    out.put(asyncio.run(run()))


def sample(tmp: str, num_shards: int, num_learners: int, seconds: float, rows: int, tag: str,
           driver: str = "blocking") -> dict[str, Any]:
    servers = start_servers(tmp, num_shards, tag, fill=rows // num_shards)
    procs = []
    main = _learner_main if driver == "blocking" else _async_learner_main
    try:
        endpoints = [s.endpoint for s in servers]
        barrier, out = SPAWN.Barrier(num_learners + 1), SPAWN.Queue()
        for _ in range(num_learners):
            procs.append(SPAWN.Process(target=main, args=(endpoints, seconds, barrier, out)))
            procs[-1].start()
        barrier.wait(120)
        results = [out.get(timeout=seconds + 60) for _ in procs]
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
        for server in servers:
            server.stop()
    times = np.concatenate([np.asarray(r[1]) for r in results])
    return {"batches_per_s": sum(r[0] for r in results), "p50_ms": float(np.percentile(times, 50)) * 1e3,
            "p99_ms": float(np.percentile(times, 99)) * 1e3}


def median(runs: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in runs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs: a smoke test")
    parser.add_argument("--actors", default="4,8", metavar="N,N", help="actor counts for ingest (default 4,8)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case (default 3)")
    parser.add_argument("--only", choices=("ingest", "sample"), help="run one section")
    args = parser.parse_args(argv)
    seconds = 1.5 if args.quick else 5.0
    repeat = 1 if args.quick else args.repeat
    rows = 20_000 if args.quick else 200_000
    print(f"load average before: {os.getloadavg()[0]:.2f} (1 min), {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    tmp = tempfile.mkdtemp(prefix="h5replay-shards-")
    try:
        print(f"\ningest: episodes of {EPISODE} x 7 float32 rows, one push each, {seconds:.0f} s per run, "
              f"median of {repeat}")
        print(f"{'actors':>6}  {'1 shard rows/s':>15}  {'2 shards rows/s':>16}  {'ratio':>6}  "
              f"{'server CPU/s (1 | 2)':>21}  {'actor CPU/s (1 | 2)':>20}")
        for actors in [int(a) for a in args.actors.split(",")] if args.only != "sample" else []:
            runs: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
            for r in range(repeat):
                for shards in ((1, 2) if r % 2 == 0 else (2, 1)):
                    runs[shards].append(ingest(tmp, shards, actors, seconds, f"ingest-{actors}-{shards}-{r}"))
            one, two = median(runs[1], "rows_per_s"), median(runs[2], "rows_per_s")
            print(f"{actors:>6}  {one:>15,.0f}  {two:>16,.0f}  {two / one:>5.2f}x  "
                  f"{median(runs[1], 'server_cpu_per_s'):>9.2f} | {median(runs[2], 'server_cpu_per_s'):<9.2f}  "
                  f"{median(runs[1], 'actor_cpu_per_s'):>8.2f} | {median(runs[2], 'actor_cpu_per_s'):<9.2f}")
        print(f"\nsample(256) from {rows:,} rows of 7 x float32 (1 shard: all; 2 shards: half each), median of {repeat}")
        print(f"{'learners':>8}  {'1 shard batch/s':>15}  {'p50/p99 ms':>12}  {'2 shards batch/s':>16}  "
              f"{'p50/p99 ms':>12}  {'ratio':>6}")
        for learners in (1, 2) if args.only != "ingest" else ():
            sruns: dict[int, list[dict[str, Any]]] = {1: [], 2: []}
            for r in range(repeat):
                for shards in ((1, 2) if r % 2 == 0 else (2, 1)):
                    sruns[shards].append(sample(tmp, shards, learners, seconds, rows, f"sample-{learners}-{shards}-{r}"))
            one, two = median(sruns[1], "batches_per_s"), median(sruns[2], "batches_per_s")
            print(f"{learners:>8}  {one:>15,.0f}  {median(sruns[1], 'p50_ms'):>5.2f}/{median(sruns[1], 'p99_ms'):<6.2f}  "
                  f"{two:>16,.0f}  {median(sruns[2], 'p50_ms'):>5.2f}/{median(sruns[2], 'p99_ms'):<6.2f}  "
                  f"{two / one:>5.2f}x")
        if args.only != "ingest":
            print(f"\nsample(256) over 2 shards, one learner: LearnerClient against AsyncLearnerClient "
                  f"(endpoints=), median of {repeat}")
            print(f"{'blocking batch/s':>16}  {'p50/p99 ms':>12}  {'asyncio batch/s':>15}  {'p50/p99 ms':>12}  {'ratio':>6}")
            druns: dict[str, list[dict[str, Any]]] = {"blocking": [], "asyncio": []}
            for r in range(repeat):
                for driver in (("blocking", "asyncio") if r % 2 == 0 else ("asyncio", "blocking")):
                    druns[driver].append(sample(tmp, 2, 1, seconds, rows, f"driver-{driver}-{r}", driver))
            one, two = median(druns["blocking"], "batches_per_s"), median(druns["asyncio"], "batches_per_s")
            print(f"{one:>16,.0f}  {median(druns['blocking'], 'p50_ms'):>5.2f}/{median(druns['blocking'], 'p99_ms'):<6.2f}  "
                  f"{two:>15,.0f}  {median(druns['asyncio'], 'p50_ms'):>5.2f}/{median(druns['asyncio'], 'p99_ms'):<6.2f}  "
                  f"{two / one:>5.2f}x")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload average after: {os.getloadavg()[0]:.2f} (1 min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
