"""Local `ReplayBuffer.sample(256)` while rows are being written, against baselines measured in
the same run: what a learner in the actor's process pays for sampling rows not yet flushed.

For small rows (obs 4 x float32, action, reward, done) and images (84x84x3 uint8), in samples per
second (medians of 3 rounds):
  * numpy memmaps of the same columns, 256 random rows gathered (the baseline);
  * `sample(256)` after `flush()`;
  * `sample(256)` from the buffer just filled, before any `flush()`;
  * one `extend` of a row, then `sample(256)`, in turn (an actor and a learner in one loop);
  * the same with `flush()` after each extend (what a user did to make sampling fast).
The target: sampling the buffer just filled, unflushed, at least 0.8x of the same after `flush()`
(PASS/MISS printed; informational, never the exit code).

    .venv/bin/python benchmarks/local_reads.py            # about a minute
    .venv/bin/python benchmarks/local_reads.py --quick    # a smoke test

Files go to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from h5replay.spaces import BinarySpace, BoxSpace, DictSpace
from h5replay.storage import ReplayBuffer

BATCH = 256


def space(images: bool) -> DictSpace:
    obs = BoxSpace(0, 255, (84, 84, 3), np.uint8) if images else BoxSpace(-np.inf, np.inf, (4,), np.float32)
    return DictSpace({"obs": obs, "action": BoxSpace(0, 1, (), np.int64),
                      "reward": BoxSpace(-np.inf, np.inf, (), np.float32), "done": BinarySpace()})


def rows(n: int, images: bool, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    obs = rng.integers(0, 256, (n, 84, 84, 3), np.uint8) if images else rng.standard_normal((n, 4)).astype(np.float32)
    return {"obs": obs, "action": rng.integers(0, 2, n), "reward": rng.standard_normal(n).astype(np.float32),
            "done": rng.random(n) < 0.01}


def rate(step: Callable[[], object], seconds: float) -> float:
    """Calls per second of `step`, median of 3 rounds of `seconds`."""
    figures = []
    for _ in range(3):
        calls, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            step()
            calls += 1
        figures.append(calls / elapsed)
    return statistics.median(figures)


def run(directory: str, images: bool, size: int, seconds: float) -> None:
    data = rows(size, images)
    maps = {}
    for name, values in data.items():
        maps[name] = np.lib.format.open_memmap(os.path.join(directory, f"{name}.npy"), "w+", values.dtype, values.shape)
        maps[name][:] = values
    rng = np.random.default_rng(1)

    def memmap_sample() -> object:
        ids = rng.integers(0, size, BATCH)
        return {name: m[ids] for name, m in maps.items()}

    baseline = rate(memmap_sample, seconds)
    print(f"{'images 84x84x3' if images else 'small rows'}: {size} rows, sample({BATCH}) per second")
    print(f"  numpy memmaps, random gather (baseline)         {baseline:9.0f}  1.00x")
    one = {name: values[:1] for name, values in data.items()}
    figures: dict[str, float] = {}
    for name, setup, step in (
        ("sample after flush()", "flush", None),
        ("sample of the buffer just filled, unflushed", "fill", None),
        ("extend 1 row, then sample, in turn", "fill", "extend"),
        ("extend 1 row, flush(), then sample, in turn", "fill", "extend+flush"),
    ):
        path = os.path.join(directory, f"rb-{name[:12].replace(' ', '_')}.h5")
        with ReplayBuffer.create(space(images), size, path) as rb:
            for first in range(0, size, 1000):
                rb.extend({k: v[first:first + 1000] for k, v in data.items()})
            if setup == "flush":
                rb.flush()

            def sample(rb: ReplayBuffer = rb, step: str | None = step) -> object:
                if step is not None:
                    rb.extend(one)
                    if step == "extend+flush":
                        rb.flush()
                return rb.sample(BATCH, rng)

            figure = rate(sample, seconds)
        os.unlink(path)
        figures[setup if step is None else step] = figure
        print(f"  {name:<47} {figure:9.0f}  {figure / baseline:.2f}x")
    ratio = figures["fill"] / figures["flush"]
    print(f"  target: the buffer just filled, unflushed, at least 0.8x of the same after flush(): {ratio:.2f}x "
          f"{'PASS' if ratio >= 0.8 else 'MISS'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small buffers and short rounds (a smoke test)")
    args = parser.parse_args()
    seconds = 0.2 if args.quick else 2.0
    directory = tempfile.mkdtemp(prefix="h5replay-bench-")
    try:
        run(directory, False, 10_000 if args.quick else 100_000, seconds)
        run(directory, True, 2_000 if args.quick else 20_000, seconds)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
