"""Helpers for tests over several servers ("shards"): a set of real servers, actor bodies, checks.

Imported as a plain module, like service_helpers (the conftests put tests/ on sys.path); worker
functions live at module level so that spawned children find them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from client_fronts import AsyncActorFront
from service_helpers import child_pids, episode_rows, file_episodes, row_problems, server_config

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import CommitInDoubtError, NotEnoughDataError, ServerUnavailableError
from h5replay.server import ServerProcess


class Shards:
    """`n` servers on loopback, each on its own file and free ports; any can be killed and
    restarted on the same file and ports. Every server still running is stopped when the block ends."""

    def __init__(self, tmp_path: Path, n: int, **changes: Any) -> None:
        self.configs: list[ServerConfig] = [server_config(tmp_path / f"shard-{i}.h5", **changes) for i in range(n)]
        self.servers: list[ServerProcess | None] = [None] * n
        try:
            for i in range(n):
                self.start(i)
        except BaseException:
            self.close()
            raise

    @property
    def endpoints(self) -> list[str]:
        return [c.bind for c in self.configs]

    @property
    def paths(self) -> list[str]:
        return [c.path for c in self.configs]

    def start(self, i: int) -> ServerProcess:
        """Start shard i: the first time on free ports (port 0), then again on the same ones."""
        server = self.servers[i] = ServerProcess(self.configs[i], timeout=60)
        self.configs[i] = dataclasses.replace(self.configs[i], bind=server.endpoint, read_bind=server.read_endpoint)
        return server

    def kill(self, i: int) -> None:
        """SIGKILL shard i's writer and its reader processes, as a lost machine would go (a reader
        alone outlives its writer by up to a second and answers reads meanwhile)."""
        server = self.servers[i]
        if server is None or not server.process.is_alive():
            return
        readers = child_pids(server.pid)
        server.kill()
        for pid in readers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(self, i: int) -> int | None:
        server = self.servers[i]
        return server.stop(timeout=30) if server is not None else None

    def close(self) -> None:
        for server in self.servers:
            if server is not None and server.process.is_alive():
                server.stop(timeout=10)


@contextlib.contextmanager
def running_shards(tmp_path: Path, n: int, **changes: Any) -> Iterator[Shards]:
    shards = Shards(tmp_path, n, **changes)
    try:
        yield shards
    finally:
        shards.close()


def episodes_by_shard(paths: list[str]) -> tuple[list[tuple[int, int, int]], list[str]]:
    """((shard, actor, episode) of every episode held in each file, problems): files reopened."""
    found, problems = [], []
    for shard, path in enumerate(paths):
        episodes, trouble = file_episodes(path)
        problems += [f"shard {shard}: {p}" for p in trouble]
        found += [(shard, actor, episode) for actor, episode in episodes]
    return found, problems


def count_problems(acknowledged: dict[tuple[int, int], int], found: list[tuple[int, int, int]]) -> list[str]:
    """Exactly once: every acknowledged episode is held once across the shards, and nothing
    that was never acknowledged is held. (An episode whose commit reply was lost with a killed
    shard is sent again with its idempotency key to that shard only, while it answers within the
    commit's time and, past it, when it answers again: the actor keeps it meanwhile.)"""
    held = Counter((actor, episode) for _, actor, episode in found)
    problems = []
    for key in acknowledged:
        if held[key] != 1:
            problems.append(f"acknowledged episode {key} is held {held[key]} times")
    for key in held:
        if key not in acknowledged:
            problems.append(f"episode {key} is held but was never acknowledged")
    return problems


def write_episodes(endpoints: list[str], actor: int, num_episodes: int, seed: int, timeout: float = 2.0,
                   pause: float = 0.01, settle_timeout: float = 60.0,
                   driver: str = "blocking") -> tuple[list[tuple[int, int]], list[int], int, int]:
    """Write `num_episodes` episodes of 1..200 steps through an actor over `endpoints`, by every
    client path, pausing `pause` s between episodes; `driver`: "blocking" (ActorClient) or
    "asyncio" (AsyncActorClient, through AsyncActorFront).

    An episode whose commit raised CommitInDoubtError is left to the actor, which settles it
    on its shard (`settle`, up to `settle_timeout` s at the end): it counts as acknowledged once
    settled.

    Returns ([(episode, length) acknowledged], [episode in doubt], home shard, failovers).

    Raises:
        ServerUnavailableError: no shard answered (the episodes acknowledged so far are lost to
            the caller: it is a failure of the test).
        RuntimeError: an episode in doubt was still not settled at the end.
    """
    rng = np.random.default_rng(seed)
    config = ClientConfig(timeout=timeout, name=f"shard-actor-{actor}", batch_seconds=0.02,
                          shard_retry_interval=0.5)
    acknowledged: list[tuple[int, int]] = []
    doubted: dict[bytes, tuple[int, int]] = {}  # key: (episode, length)
    front = ActorClient if driver == "blocking" else AsyncActorFront
    with front(config=config, endpoints=endpoints) as client:
        home = client.shard
        for e in range(num_episodes):
            n = int(rng.integers(1, 201))
            rows = episode_rows(actor, e, n)
            how = int(rng.integers(0, 3))
            try:
                if how == 0:
                    receipt = client.push_episode(rows)
                elif how == 1:
                    with client.segment() as seg:
                        for i in range(n):
                            seg.append({k: v[i] for k, v in rows.items()})
                    receipt = seg.receipt  # type: ignore[assignment]
                else:
                    seg = client.segment()
                    cuts = sorted(set(rng.integers(0, n, size=3).tolist()) | {0, n})
                    for lo, hi in zip(cuts, cuts[1:]):
                        seg.extend({k: v[lo:hi] for k, v in rows.items()})
                    receipt = seg.commit()
            except CommitInDoubtError as exc:  # kept by the actor, settled on its shard later
                doubted[exc.key] = (e, n)
                continue
            if receipt is None or receipt.length != n:
                raise RuntimeError(f"episode {e}: receipt {receipt} for {n} rows")
            acknowledged.append((e, n))
            time.sleep(pause)
        left = client.settle(settle_timeout)
        if left:
            raise RuntimeError(f"actor {actor}: {len(left)} episode(s) still in doubt after {settle_timeout} s: {left}")
        for record in client.in_doubt:
            e, n = doubted[record.key]
            if record.receipt is None or record.receipt.length != n:
                raise RuntimeError(f"episode {e} in doubt: settled with receipt {record.receipt} for {n} rows")
            acknowledged.append((e, n))
        failovers = client._router.num_failovers if client._router is not None else 0
    return acknowledged, sorted(e for e, _ in doubted.values()), home, failovers


def sharded_actor_main(endpoints: list[str], actor: int, num_episodes: int, seed: int, out: Any,
                       timeout: float = 2.0, pause: float = 0.01, driver: str = "blocking") -> None:
    """`write_episodes` in a process: puts ("done", actor, acknowledged, doubted, home, failovers)
    on `out`, or ("error", actor, message) when the actor gave up."""
    try:
        out.put(("done", actor, *write_episodes(endpoints, actor, num_episodes, seed, timeout, pause,
                                                driver=driver)))
    except ServerUnavailableError as exc:
        out.put(("error", actor, str(exc)))


def sample_for(endpoints: list[str], seconds: float, timeout: float = 2.0) -> dict[str, Any]:
    """Sample batches of 64 from every shard for `seconds`, checking every row; returns the number
    of batches, the problems found, the shards seen and the calls that skipped each shard."""
    config = ClientConfig(timeout=timeout, name="shard-learner", shard_retry_interval=0.5)
    batches, problems, seen = 0, [], set()
    deadline = time.monotonic() + seconds
    with LearnerClient(config=config, endpoints=endpoints) as learner:
        while time.monotonic() < deadline:
            try:
                batch, info = learner.sample(64, with_info=True)
            except NotEnoughDataError:
                time.sleep(0.05)
                continue
            problems += row_problems(batch)
            seen.update(info.shard_ids.tolist())
            batches += 1
            time.sleep(0.005)
        skipped = list(learner.shards.num_skipped) if learner.shards is not None else []
    return {"batches": batches, "problems": problems[:10], "shards_seen": sorted(seen), "skipped": skipped}
