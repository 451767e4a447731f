"""n-step transitions, locally, against baselines measured in the same run.

`sample_transitions(256, n_step=n)` from a buffer of 100k CartPole-like steps (obs 4 x float32,
action, reward, terminated, truncated) in 200-step episodes with final observations, in batches
per second, against
  * `sample(256)` of the same buffer (what a learner paid before transitions existed), and
  * the plain numpy baseline: uniform random ids, a fancy-indexed read of every column from numpy
    memmaps, the next observations and `n` rewards read by index and summed (what a learner
    would write by hand over arrays, ignoring episode ends).

    .venv/bin/python benchmarks/transitions.py            # about a minute
    .venv/bin/python benchmarks/transitions.py --quick    # a smoke test

Files go to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

import numpy as np
from tables import rate  # benchmarks/tables.py: calls per second, median of 3 rounds

from h5replay.spaces import BinarySpace, BoxSpace, DictSpace
from h5replay.storage import ReplayBuffer

SPACE = DictSpace({"obs": BoxSpace(-np.inf, np.inf, (4,), np.float32), "action": BoxSpace(0, 1, (), np.int64),
                   "reward": BoxSpace(-np.inf, np.inf, (), np.float32), "terminated": BinarySpace(),
                   "truncated": BinarySpace()})
EPISODE = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short rounds and a small buffer (a smoke test)")
    args = parser.parse_args()
    rows, seconds = (10_000, 0.2) if args.quick else (100_000, 3.0)
    directory = tempfile.mkdtemp(prefix="h5replay-bench-")
    try:
        rng = np.random.default_rng(0)
        columns = {"obs": rng.standard_normal((rows, 4)).astype(np.float32), "action": rng.integers(0, 2, rows),
                   "reward": np.ones(rows, np.float32), "terminated": (np.arange(rows) % EPISODE) == EPISODE - 1,
                   "truncated": np.zeros(rows, bool)}
        maps = {}
        for name, values in columns.items():
            maps[name] = np.lib.format.open_memmap(os.path.join(directory, f"{name}.npy"), "w+", values.dtype,
                                                   values.shape)
            maps[name][:] = values
        draw = np.random.default_rng(1)
        with ReplayBuffer.create(SPACE, rows, os.path.join(directory, "rb.h5"), observation_keys=("obs",)) as rb:
            for first in range(0, rows, EPISODE):
                rb.extend({name: values[first:first + EPISODE] for name, values in columns.items()})
                rb.end_episode(final=np.zeros(4, np.float32))
            rb.flush()
            print(f"sample_transitions(256), {rows} steps in {EPISODE}-step episodes, medians of 3 rounds of {seconds} s")
            for n in (1, 3, 5):
                weights = 0.99 ** np.arange(n)

                def by_hand(n: int = n, weights: np.ndarray = weights) -> object:
                    ids = np.sort(draw.integers(0, rows - n, 256))
                    out = {name: m[ids] for name, m in maps.items()}
                    out["next"] = maps["obs"][ids + n]
                    out["reward"] = (maps["reward"][ids[:, None] + np.arange(n)] * weights).sum(axis=1)
                    return out

                base = rate(by_hand, seconds)
                plain = rate(lambda: rb.sample(256, draw), seconds)
                got = rate(lambda n=n: rb.sample_transitions(256, n_step=n, rng=draw), seconds)
                print(f"  n_step={n}: numpy memmap by hand {base:8.0f}/s   sample(256) {plain:8.0f}/s   "
                      f"sample_transitions {got:8.0f}/s = {got / base:.2f}x numpy, {got / plain:.2f}x sample")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
