"""Sampling control's figures (issue 10), each against a baseline measured in the same run.

1. Prioritized `sample(256)` over the wire against uniform `sample(256)` over the wire: two
   servers on the same data (100k rows of 16 x float32), one learner, alternating rounds.
   Target: prioritized at least 0.8x uniform.
2. `update_priorities` of 256 ids: calls per second locally (ReplayBuffer) and over the wire
   (LearnerClient), against a raw ZeroMQ DEALER/ROUTER round trip of the same 4 KiB message.
   Over the wire a call returns once the writer has applied the update and published it (log
   entries written, file flushed, readers see them) at the end of its pass (so one learner
   calling in turn causes a publish per call); as a second figure with
   priority_publish_interval=0.002 (a pass of updates alone publishes them once the oldest is
   2 ms old, and a waited call waits for that publish), and with `wait=False` (up to
   max_in_flight messages travelling, the updates made meanwhile held by the client and sent
   merged; every reply read by the end of the round). Target: at least 5,000 calls/s.
3. A rate-limited run: 4 actor processes, 1 learner, samples_per_insert 8: the observed ratio
   sampled / inserted, and how long each side waited for the limiter, against the same processes
   with no rate limit (the baseline: rows in and batches out per second).

    .venv/bin/python benchmarks/sampling.py            # about two minutes
    .venv/bin/python benchmarks/sampling.py --quick    # a smoke test

Servers bind 127.0.0.1 on free ports; files go to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import zmq

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig, ServerConfig
from h5replay.errors import RateLimitedError
from h5replay.sampling import Prioritized, RateLimit, SamplingConfig, Uniform
from h5replay.server import ServerProcess
from h5replay.storage import BoxSpace, ReplayBuffer

SPACE = BoxSpace(-1, 1, (16,), np.float32)
BATCH = 256
SPAWN = mp.get_context("spawn")


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def server(directory: str, name: str, sampling: SamplingConfig, capacity: int | None = 200_000,
           **changes: Any) -> ServerProcess:
    config = ServerConfig(path=os.path.join(directory, name), space=SPACE, capacity=capacity,
                          bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0", sampling=sampling, **changes)
    return ServerProcess(config, timeout=60)


def fill(endpoint: str, rows: int, prioritized: bool) -> None:
    rng = np.random.default_rng(0)
    with ActorClient(endpoint, timeout=30) as actor:
        for _ in range(0, rows, 1000):
            batch = rng.uniform(-1, 1, (1000, 16)).astype(np.float32)
            actor.push_episode(batch, priorities=rng.random(1000) + 0.01 if prioritized else None)


# ------------------------------------------------------------------------------------------- 1


def sample_rate(learner: LearnerClient, seconds: float) -> float:
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        learner.sample(BATCH)
        done += 1
    return done / (time.perf_counter() - started)


def prioritized_against_uniform(directory: str, rows: int, rounds: int, seconds: float) -> None:
    uniform = server(directory, "uniform.h5", SamplingConfig(Uniform()))
    prioritized = server(directory, "prioritized.h5", SamplingConfig(Prioritized(0.6)))
    try:
        fill(uniform.endpoint, rows, False)
        fill(prioritized.endpoint, rows, True)
        with LearnerClient(uniform.endpoint, timeout=30) as lu, LearnerClient(prioritized.endpoint, timeout=30) as lp:
            lu.sample(BATCH)
            lp.sample(BATCH)
            u, p = [], []
            for _ in range(rounds):  # alternate, so a slow spell of this shared host hits both alike
                u.append(sample_rate(lu, seconds))
                p.append(sample_rate(lp, seconds))
        mu, mp_ = float(np.median(u)), float(np.median(p))
        print(f"1. sample({BATCH}) over the wire, {rows} rows of 16 x f32, medians of {rounds} rounds of {seconds} s")
        print(f"   uniform      {mu:8.0f} batches/s  (baseline)")
        print(f"   prioritized  {mp_:8.0f} batches/s  {mp_ / mu:5.2f}x uniform   target >= 0.8x: {verdict(mp_ / mu >= 0.8)}")
    finally:
        uniform.stop()
        prioritized.stop()


# ------------------------------------------------------------------------------------------- 2


def raw_zmq_round_trips(seconds: float) -> float:
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    payload = np.zeros(256 * 2, np.float64).tobytes()  # 256 ids + 256 priorities
    stop = threading.Event()

    def echo() -> None:
        while not stop.is_set():
            if router.poll(50):
                frames = router.recv_multipart()
                router.send_multipart([frames[0], b"ok"])

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        dealer.send_multipart([b"h", payload])
        dealer.recv_multipart()
        done += 1
    rate = done / (time.perf_counter() - started)
    stop.set()
    thread.join()
    dealer.close(0)
    router.close(0)
    ctx.term()
    return rate


def calls_per_second(call: Any, ids: list[np.ndarray], values: list[np.ndarray], seconds: float,
                     finish: Any = None) -> float:
    """Calls of `call` per second for `seconds`, `finish()` (waiting for pipelined replies) included."""
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call(ids[done % 64], values[done % 64])
        done += 1
    if finish is not None:
        finish()
    return done / (time.perf_counter() - started)


def update_rates(directory: str, rows: int, rounds: int, seconds: float) -> None:
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, rows, BATCH) for _ in range(64)]
    values = [rng.random(BATCH) for _ in range(64)]
    servers = [server(directory, "wire.h5", SamplingConfig(Prioritized(0.6))),
               server(directory, "wire-2ms.h5", SamplingConfig(Prioritized(0.6)), priority_publish_interval=0.002)]
    rb = ReplayBuffer.create(SPACE, rows, os.path.join(directory, "local.h5"), sampler=Prioritized(0.6))
    try:
        rb.extend(np.zeros((rows, 16), np.float32))
        for s in servers:
            fill(s.endpoint, rows, True)
        with LearnerClient(servers[0].endpoint, timeout=30) as wire, \
                LearnerClient(servers[1].endpoint, timeout=30) as interval:
            for learner in (wire, interval):  # as a learner does: its updates name rows it has sampled
                learner.sample(BATCH)
            cases = {"raw": lambda i, v: None, "local": rb.update_priorities, "wire": wire.update_priorities,
                     "interval": interval.update_priorities,
                     "pipelined": lambda i, v: wire.update_priorities(i, v, wait=False)}
            got: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(rounds):  # alternate, so a slow spell of this shared host hits all of them alike
                got["raw"].append(raw_zmq_round_trips(seconds))
                for name in ("local", "wire", "interval"):
                    got[name].append(calls_per_second(cases[name], ids, values, seconds))
                got["pipelined"].append(calls_per_second(cases["pipelined"], ids, values, seconds,
                                                         wire.flush_priorities))
    finally:
        rb.close()
        for s in servers:
            s.stop()
    raw, local, wire_rate, within, pipelined = (float(np.median(got[k]))
                                                for k in ("raw", "local", "wire", "interval", "pipelined"))
    print(f"2. update_priorities of {BATCH} ids, {rows} rows held, medians of {rounds} rounds of {seconds} s")
    print(f"   raw ZeroMQ round trip, same bytes  {raw:8.0f} calls/s  (baseline)")
    print(f"   ReplayBuffer (local)               {local:8.0f} calls/s  {local / raw:5.2f}x   target >= 5000: "
          f"{verdict(local >= 5000)}")
    print(f"   LearnerClient (wire)               {wire_rate:8.0f} calls/s  {wire_rate / raw:5.2f}x   target >= 5000: "
          f"{verdict(wire_rate >= 5000)}")
    print(f"   the same, publishing within 2 ms   {within:8.0f} calls/s  {within / raw:5.2f}x   "
          f"(priority_publish_interval=0.002)")
    print(f"   LearnerClient, wait=False          {pipelined:8.0f} calls/s  {pipelined / raw:5.2f}x   target >= 5000: "
          f"{verdict(pipelined >= 5000)} (max_in_flight={ClientConfig().max_in_flight} messages travelling)")


# ------------------------------------------------------------------------------------------- 3


def actor_main(endpoint: str, actor: int, seconds: float, out: Any) -> None:
    rows = np.zeros((100, 16), np.float32)
    config = ClientConfig(endpoint=endpoint, timeout=30, name=f"actor-{actor}", rate_limit_timeout=30)
    done = 0
    with ActorClient(config=config) as client:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            try:
                client.push_episode(rows)
            except RateLimitedError:
                break  # the learner stopped first: no one samples any more, so inserts wait in vain
            done += 100
    out.put(("actor", done))


def learner_main(endpoint: str, seconds: float, out: Any) -> None:
    config = ClientConfig(endpoint=endpoint, timeout=30, name="learner", rate_limit_timeout=30)
    done = 0
    with LearnerClient(config=config) as client:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            client.sample(BATCH)
            done += 1
        stats = client.info()  # the waits of the run itself (actors then wait in vain for a learner)
    out.put(("learner", (done, stats)))


def run_processes(endpoint: str, seconds: float) -> tuple[float, float, dict[str, Any]]:
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=actor_main, args=(endpoint, a, seconds, out)) for a in range(4)]
    procs.append(SPAWN.Process(target=learner_main, args=(endpoint, seconds, out)))
    for p in procs:
        p.start()
    rows = batches = 0
    stats: dict[str, Any] = {}
    for _ in procs:
        kind, n = out.get(timeout=seconds + 120)
        if kind == "actor":
            rows += n
        else:
            batches, stats = n
    for p in procs:
        p.join(60)
    return rows / seconds, batches / seconds, stats


def rate_limited_run(directory: str, seconds: float) -> None:
    spi, error_buffer = 8.0, 4096.0
    free = server(directory, "free.h5", SamplingConfig(rate_limit=RateLimit(min_size_to_sample=1000)))
    limited = server(directory, "limited.h5", SamplingConfig(
        rate_limit=RateLimit(min_size_to_sample=1000, samples_per_insert=spi, error_buffer=error_buffer)))
    try:
        base_rows, base_batches, _ = run_processes(free.endpoint, seconds)
        rows, batches, stats = run_processes(limited.endpoint, seconds)
    finally:
        free.stop()
        limited.stop()
    # The limiter keeps inserted * spi - sampled within min_size_to_sample * spi +- error_buffer.
    ratio, inserted, offset = stats["sampled"] / max(1, stats["inserted"]), max(1, stats["inserted"]), 1000 * spi
    low, high = spi - (offset + error_buffer) / inserted, spi - (offset - error_buffer) / inserted
    print(f"3. 4 actors (100-row episodes) and 1 learner (sample({BATCH})), {seconds} s each run")
    print(f"   no ratio limit   {base_rows:9.0f} rows in/s  {base_batches:7.0f} batches out/s  "
          f"(baseline: {base_batches * BATCH / max(1.0, base_rows):.2f} rows sampled per row inserted)")
    print(f"   samples_per_insert={spi:g}, error_buffer={error_buffer:g}: {rows:9.0f} rows in/s "
          f"({rows / base_rows:.2f}x)  {batches:7.0f} batches out/s ({batches / max(1e-9, base_batches):.2f}x)")
    print(f"   observed ratio {ratio:.3f} (the limiter's window now: [{low:.3f}, {high:.3f}]: "
          f"{verdict(low - 1e-9 <= ratio <= high + 1e-9)})")
    print(f"   waited: actors {stats['insert_wait_s']:.1f} s in all ({stats['insert_wait_s'] / (4 * seconds):.0%} "
          f"of their time), learner {stats['sample_wait_s']:.1f} s ({stats['sample_wait_s'] / seconds:.0%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small and short")
    parser.add_argument("--only", type=int, choices=(1, 2, 3), action="append",
                        help="run only this figure (1, 2 or 3; may be given twice)")
    args = parser.parse_args()
    rows, rounds, seconds, run = (20_000, 2, 0.5, 3.0) if args.quick else (100_000, 5, 2.0, 15.0)
    only = set(args.only or (1, 2, 3))
    directory = tempfile.mkdtemp(prefix="h5r-bench-sampling-")
    try:
        print(f"h5replay sampling benchmark, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
        if 1 in only:
            prioritized_against_uniform(directory, rows, rounds, seconds)
        if 2 in only:
            update_rates(directory, rows, rounds, seconds)
        if 3 in only:
            rate_limited_run(directory, run)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
