"""Tables and samplers, locally, each against a baseline measured in the same run.

1. `sample(256)` from a buffer of 100k rows of 16 x float32 by each sampler (Uniform,
   Prioritized(0.6), Recency(10k), Mixture of Uniform and Recency), in batches per second, against
   the plain numpy baseline: uniform random ids and a fancy-indexed read from a numpy memmap of
   the same rows.
2. Inserts with one table against three (a prioritized replay, a FIFO queue, a rate-limited
   uniform table): `extend` of 64-row episodes with priorities, rows per second, the one-table
   buffer the baseline.

    .venv/bin/python benchmarks/tables.py            # about a minute
    .venv/bin/python benchmarks/tables.py --quick    # a smoke test

Files go to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable

import numpy as np

from h5replay.sampling import Fifo, Mixture, Prioritized, RateLimit, Recency, Table, Uniform
from h5replay.storage import BoxSpace, ReplayBuffer

SPACE = BoxSpace(-np.inf, np.inf, (16,), np.float32)


def rate(call: Callable[[], object], seconds: float) -> float:
    """Calls per second, median of 3 rounds of `seconds`."""
    rounds = []
    for _ in range(3):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            call()
            n += 1
        rounds.append(n / (time.perf_counter() - start))
    return float(np.median(rounds))


def sampling(directory: str, rows: int, seconds: float) -> None:
    data = np.random.default_rng(0).standard_normal((rows, 16)).astype(np.float32)
    memmap = np.lib.format.open_memmap(os.path.join(directory, "rows.npy"), "w+", np.float32, data.shape)
    memmap[:] = data
    memmap.flush()
    rng = np.random.default_rng(1)
    base = rate(lambda: memmap[np.sort(rng.integers(0, rows, 256))], seconds)
    print(f"1. sample(256), {rows} rows of 16 x f32, medians of 3 rounds of {seconds} s")
    print(f"   numpy memmap      {base:8.0f} batches/s  (baseline)")
    samplers = {"uniform": Uniform(), "prioritized": Prioritized(0.6), "recency": Recency(10_000),
                "mixture": Mixture({Uniform(): 0.5, Recency(10_000): 0.5})}
    for name, sampler in samplers.items():
        path = os.path.join(directory, f"{name}.h5")
        with ReplayBuffer.create(SPACE, rows, path, sampler=sampler) as rb:
            for first in range(0, rows, 10_000):
                rb.extend(data[first : first + 10_000], priorities=np.ones(min(10_000, rows - first))
                          if sampler.prioritized_part is not None else None)
                rb.end_episode()
        with ReplayBuffer.load_from(path, read_only=False) as rb:  # reopened: rows read through the memory map
            got = rate(lambda rb=rb: rb.sample(256, rng), seconds)
        print(f"   {name:<16} {got:8.0f} batches/s  {got / base:5.2f}x numpy")


def inserts(directory: str, episodes: int, seconds: float) -> None:
    batch = np.zeros((64, 16), np.float32)
    priorities = np.ones(64)
    one = {"replay": Table(Prioritized(0.6))}
    three = {**one, "queue": Table(Fifo(), max_times_sampled=1),
             "limited": Table(rate_limit=RateLimit(1, 1.0, 1e12))}
    figures = {}
    for name, tables in (("one table", one), ("three tables", three)):
        path = os.path.join(directory, f"insert-{name.replace(' ', '-')}.h5")
        with ReplayBuffer.create(SPACE, episodes * 64, path, tables=tables) as rb:

            def insert(rb: ReplayBuffer = rb) -> None:
                rb.extend(batch, priorities=priorities)
                rb.end_episode()
                rb.flush()

            figures[name] = rate(insert, seconds) * 64
    print(f"2. extend(64 rows) + flush, rows per second, medians of 3 rounds of {seconds} s")
    print(f"   one table         {figures['one table']:9.0f} rows/s  (baseline)")
    ratio = figures["three tables"] / figures["one table"]
    print(f"   three tables      {figures['three tables']:9.0f} rows/s  {ratio:5.2f}x one table")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke test: small and short")
    args = parser.parse_args()
    rows, seconds = (20_000, 0.2) if args.quick else (100_000, 2.0)
    load = os.getloadavg()[0]
    print(f"h5replay tables benchmark, {os.cpu_count()} CPUs, load {load:.1f}")
    directory = tempfile.mkdtemp(prefix="h5r-bench-tables-")
    try:
        sampling(directory, rows, seconds)
        inserts(directory, 2000, seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
