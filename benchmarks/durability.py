"""What `serve --fsync` costs: commit latency of a ReplayBuffer with and without fsync per commit.

    .venv/bin/python benchmarks/durability.py [--episodes N] [--steps S]

Commits episodes of S rows of 7 float32 (and of 84x84x3 uint8) into an SWMR file, as the server
does: `commit_segment` (rows, then the published state, each flushed to the OS), and in the fsync
case also `flush(fsync=True)`, as `serve --fsync` does after every commit. Prints p50/p99 commit
latency and commits/s side by side, and the ratio. Files live in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from h5replay.storage import BoxSpace, ReplayBuffer  # noqa: E402

ROWS = {"7xf32": BoxSpace(-1, 1, (7,)), "84x84x3u8": BoxSpace(0, 255, (84, 84, 3), np.uint8)}


def commit_times(path: str, space: BoxSpace, episodes: int, steps: int, fsync: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    batch = space.sample(rng)[None].repeat(steps, axis=0)
    times = np.empty(episodes)
    with ReplayBuffer.create(space, episodes * steps, path, multiprocessing=True) as rb:
        for e in range(episodes):
            writer = rb.open_segment_writer()
            writer.extend(batch)
            started = time.perf_counter()
            rb.commit_segment(writer)
            if fsync:
                rb.storage.flush(fsync=True)
            times[e] = time.perf_counter() - started
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=300)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(f"{'rows':<10} {'mode':<8} {'commits/s':>10} {'p50 ms':>8} {'p99 ms':>8} {'vs no fsync':>12}")
    with tempfile.TemporaryDirectory(prefix="h5replay-durability-") as tmp:
        for name, space in ROWS.items():
            base = None
            for fsync in (False, True):
                path = os.path.join(tmp, f"{name}-{fsync}.h5")
                t = commit_times(path, space, args.episodes, args.steps, fsync)
                rate = len(t) / t.sum()
                base = rate if base is None else base
                print(f"{name:<10} {'fsync' if fsync else 'flush':<8} {rate:>10,.0f} {np.percentile(t, 50) * 1e3:>8.2f} "
                      f"{np.percentile(t, 99) * 1e3:>8.2f} {rate / base:>11.2f}x")
                os.unlink(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
