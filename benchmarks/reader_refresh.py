"""What a reader pays to catch up after a commit, as the history it holds grows.

A writer process holds a buffer of N episodes (1k, 10k, 100k; two rows each, 7 x float32) in SWMR
mode; a reader process (an SWMR reader, as the server's readers are) times `sample(256)` in two
ways, interleaved: with nothing changed since its last read (the baseline, measured in the same
run), and right after the writer committed one more episode. The ratio is what a publish costs a
reader; it should not grow with N (target: within 2x of the baseline at 100k episodes).

    .venv/bin/python benchmarks/reader_refresh.py            # about a minute
    .venv/bin/python benchmarks/reader_refresh.py --quick    # a smoke test

Files go to a temporary directory that is removed at the end; nothing touches the network.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np

from h5replay.storage import BoxSpace, ReplayBuffer

SPACE = BoxSpace(-1, 1, (7,), np.float32)
BATCH = 256


def reader_main(path: str, conn: Any, rounds: int) -> None:
    rb = ReplayBuffer.load_from(path, read_only=True, multiprocessing=True)
    rng = np.random.default_rng(0)
    rb.sample(BATCH, rng)  # maps the file, loads the table
    still, after = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        rb.sample(BATCH, rng)
        still.append(time.perf_counter() - started)
        conn.send("commit")
        conn.recv()  # the writer has published one more episode
        started = time.perf_counter()
        rb.sample(BATCH, rng)
        after.append(time.perf_counter() - started)
    conn.send(("done", float(np.median(still)), float(np.median(after)), len(rb)))
    rb.close()


def measure(directory: str, episodes: int, rounds: int) -> tuple[float, float, int]:
    path = os.path.join(directory, f"rb{episodes}.h5")
    rb = ReplayBuffer.create(SPACE, None, path, multiprocessing=True)
    rows = np.zeros((2, 7), np.float32)
    for _ in range(episodes):
        rb.extend(rows)
        rb.end_episode()
    rb.flush()
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=reader_main, args=(path, there, rounds))
    proc.start()
    try:
        while True:
            if not here.poll(120):
                raise RuntimeError("the reader stopped answering")
            message = here.recv()
            if message == "commit":
                writer = rb.open_segment_writer()
                writer.extend(rows)
                rb.commit_segment(writer)
                here.send("ok")
                continue
            _, still, after, length = message
            return still, after, length
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        rb.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1k and 10k episodes, few rounds")
    args = parser.parse_args(argv)
    sizes = [1_000, 10_000] if args.quick else [1_000, 10_000, 100_000]
    rounds = 20 if args.quick else 60
    directory = tempfile.mkdtemp(prefix="h5replay-bench-")
    try:
        print(f"sample({BATCH}) by an SWMR reader process, median of {rounds} rounds", file=sys.stderr)
        print("| episodes held | no change (ms) | after a commit (ms) | ratio | target |")
        print("|---|---|---|---|---|")
        for episodes in sizes:
            still, after, length = measure(directory, episodes, rounds)
            ratio = after / still
            verdict = "PASS" if ratio <= 2.0 else "MISS"
            print(f"| {episodes:,} ({length:,} rows) | {still * 1e3:.3f} | {after * 1e3:.3f} | {ratio:.2f}x | "
                  f"<= 2x {verdict} |", flush=True)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
