"""Load: 32 actor processes of mixed episode lengths and 4 learners against one server, for a few
minutes on loopback. Server memory, open file handles and file size stay within bounds, no
commit is lost, and the commit latency (p50 / p99, from the actors' own clocks) is reported.

Opt-in (see conftest.py): `pytest -m soak -s tests/soak`. H5REPLAY_SOAK_SECONDS sets the length
of the full-load phase (default 100 s; the 36 processes take a minute to start on 2 cores).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from fault_helpers import (
    CrashHistory,
    children_of,
    drain,
    process_figures,
    read_file_state,
    soak_actor_main,
    soak_learner_main,
)
from service_helpers import SPAWN, processes, server_config

from h5replay.server import ServerProcess

pytestmark = pytest.mark.soak

NUM_ACTORS = 32
NUM_LEARNERS = 4
SECONDS = float(os.environ.get("H5REPLAY_SOAK_SECONDS", "100"))
CAPACITY = 200_000  # rows (80 bytes each): the ring wraps several times
MAX_LEN = 3000
SAMPLE_EVERY = 3.0
MiB = 1 << 20


@pytest.mark.timeout(SECONDS + 420)
def test_soak(tmp_path):
    path = tmp_path / "soak.h5"
    config = server_config(path, capacity=CAPACITY, num_readers=2, session_timeout=120.0, heartbeat_timeout=5.0)
    server = ServerProcess(config, timeout=60)
    stop, out = SPAWN.Event(), SPAWN.Queue()
    samples: list[tuple[float, int, int, int, int, int]] = []  # t, rss, fds, threads, reader rss, file bytes
    reports: list = []
    try:
        with processes() as procs:
            for actor in range(1, NUM_ACTORS + 1):
                procs.append(SPAWN.Process(target=soak_actor_main, args=(server.endpoint, actor, actor, stop, out)))
            for learner in range(NUM_LEARNERS):
                procs.append(SPAWN.Process(target=soak_learner_main, args=(server.endpoint, learner, stop, out)))
            started = time.monotonic()
            for proc in procs:
                proc.start()
            # Load runs for SECONDS after every client process is up (they take a while on 2 cores).
            load_from = None
            while True:
                now = time.monotonic()
                rss, fds, threads = process_figures(server.pid)
                reader_rss = sum(process_figures(pid)[0] for pid in children_of(server.pid))
                samples.append((now - started, rss, fds, threads, reader_rss, os.path.getsize(path)))
                if load_from is None and server_clients(server) >= NUM_ACTORS + NUM_LEARNERS:
                    load_from = now
                    print(f"\nall {NUM_ACTORS + NUM_LEARNERS} clients connected after {now - started:.0f} s")
                if load_from is not None and now - load_from >= SECONDS:
                    break
                assert now - started < SECONDS + 240, "the clients never all connected"
                assert server.process.is_alive(), "the server died"
                time.sleep(SAMPLE_EVERY)
            stop.set()
            ran = time.monotonic() - started
            deadline = time.monotonic() + 120
            while len(reports) < len(procs) and time.monotonic() < deadline:
                drain(out, reports, timeout=1.0)
            for proc in procs:
                proc.join(30)
    finally:
        stop.set()
        exit_code = server.stop(60)
    assert exit_code == 0
    assert len(reports) == NUM_ACTORS + NUM_LEARNERS, f"{len(reports)} reports"

    actors = [r for r in reports if r[0] == "soak-actor"]
    learners = [r for r in reports if r[0] == "soak-learner"]
    for _, actor, _, _, errors in actors:
        assert not errors, f"actor {actor}: {errors}"
    for _, seed, problems, reads, _ in learners:
        assert not problems, f"learner {seed}: {problems}"
        assert reads > 0

    # No commit lost: every acknowledged episode is in the file unless later commits evicted it.
    history = CrashHistory()
    for _, actor, acks, _, _ in actors:
        for e, n, eid in acks:
            history.started[(actor, e)] = (n, False)
            history.acks[(actor, e)] = (n, eid)
    state = read_file_state(path, MAX_LEN)
    problems = state.problems + history.problems(state, MAX_LEN)
    assert not problems, problems

    latencies = np.concatenate([np.asarray(r[3]) for r in actors])
    read_latencies = np.concatenate([np.asarray(r[4]) for r in learners])
    t, rss, fds, threads, reader_rss, size = (np.array(col) for col in zip(*samples))
    warm = t >= t[0] + (load_from - started if load_from else 0) + 30  # after 30 s of full load
    rows = sum(n for r in actors for _, n, _ in r[2])
    print(f"soak: {len(latencies)} commits, {rows} rows ({rows / ran:.0f} rows/s) in {ran:.0f} s by {NUM_ACTORS} "
          f"actors ({SECONDS:.0f} s with all connected); {len(read_latencies)} learner reads (sample 256 + 32x8 sequences)")
    print(f"  commit latency p50 {np.percentile(latencies, 50) * 1000:.1f} ms, p99 "
          f"{np.percentile(latencies, 99) * 1000:.1f} ms, max {latencies.max() * 1000:.0f} ms; learner read p50 "
          f"{np.percentile(read_latencies, 50) * 1000:.1f} ms, p99 {np.percentile(read_latencies, 99) * 1000:.1f} ms")
    print(f"  writer RSS {rss[0] / MiB:.0f} -> {rss[warm][0] / MiB:.0f} (warm) -> max {rss.max() / MiB:.0f} MiB; "
          f"readers RSS max {reader_rss.max() / MiB:.0f} MiB; fds {fds[warm].min()}..{fds[warm].max()}; threads "
          f"{threads.min()}..{threads.max()}; file {size[warm][0] / MiB:.1f} -> {size[-1] / MiB:.1f} MiB "
          f"(ring of {CAPACITY * 80 / MiB:.1f} MiB)")
    assert state.total_rows > 2 * CAPACITY, "the ring did not wrap: raise SECONDS or lower CAPACITY"
    assert rss[warm].max() - rss[warm][0] < 200 * MiB, "writer memory grows under steady load"
    assert reader_rss[warm].max() - reader_rss[warm][0] < 200 * MiB, "reader memory grows under steady load"
    assert fds[warm].max() - fds[warm].min() <= 8, "open file handles grow under steady load"
    assert size[-1] < size[warm][0] + 64 * MiB, "the file keeps growing after the ring is full"
    assert np.percentile(latencies, 99) < 5.0


def server_clients(server: ServerProcess) -> int:
    from h5replay.client import ActorClient

    with ActorClient(server.endpoint, timeout=30, name="soak-probe") as probe:
        return int(probe.info()["clients"]) - 1
