"""PyTorch DataLoaders over h5replay, against baselines measured in the same run: what
`num_workers` buys.

Streaming (`H5ReplayDataset` of a server on 127.0.0.1, `batch_size=None`), batches of 256 per
second over a whole pass of `--batches` batches, worker start included, for num_workers 0, 1
and 2, against the same server read by one `LearnerClient.batches(256)` loop without PyTorch.

Offline (`H5ReplayMapDataset` of a local file, `DataLoader(batch_size=256, shuffle=True)`), one
shuffled pass over every row, against the numpy baseline: the same shuffled batches
fancy-indexed from numpy memmaps of the same columns (copied into tensors).

Rows are CartPole-like (obs 4 x float32, action, reward, terminated, truncated) or, with
`--images`, 84x84x3 uint8 frames.

    .venv/bin/python benchmarks/torch_loader.py            # about a minute
    .venv/bin/python benchmarks/torch_loader.py --images
    .venv/bin/python benchmarks/torch_loader.py --quick    # a smoke test

Files go to a temporary directory removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader

from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ServerConfig
from h5replay.integrations.torch import H5ReplayDataset, H5ReplayMapDataset
from h5replay.server import ServerProcess
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace

EPISODE, BATCH = 200, 256


def space(images: bool) -> DictSpace:
    obs = BoxSpace(0, 255, (84, 84, 3), np.uint8) if images else BoxSpace(-np.inf, np.inf, (4,), np.float32)
    return DictSpace({"obs": obs, "action": BoxSpace(0, 1, (), np.int64), "reward": BoxSpace(-np.inf, np.inf, (), np.float32),
                      "terminated": BinarySpace(), "truncated": BinarySpace()})


def columns(rows: int, images: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    obs = rng.integers(0, 256, (rows, 84, 84, 3), np.uint8) if images else rng.standard_normal((rows, 4)).astype(np.float32)
    return {"obs": obs, "action": rng.integers(0, 2, rows), "reward": np.ones(rows, np.float32),
            "terminated": (np.arange(rows) % EPISODE) == EPISODE - 1, "truncated": np.zeros(rows, bool)}


def timed(batches: object, count: int) -> float:
    """Batches per second over `count` batches of an iterable (its start included)."""
    started = time.perf_counter()
    seen = 0
    for _ in batches:  # type: ignore[attr-defined]
        seen += 1
        if seen == count:
            break
    return seen / (time.perf_counter() - started)


def streaming(directory: str, data: dict[str, np.ndarray], images: bool, count: int) -> None:
    config = ServerConfig(path=os.path.join(directory, "served.h5"), space=space(images), capacity=len(data["action"]),
                          bind="tcp://127.0.0.1:0", read_bind="tcp://127.0.0.1:0")
    server = ServerProcess(config)
    try:
        with ActorClient(server.endpoint, timeout=60) as actor:
            for first in range(0, len(data["action"]), EPISODE):
                actor.push_episode({k: v[first:first + EPISODE] for k, v in data.items()})
        with LearnerClient(server.endpoint, timeout=60) as learner:
            baseline = timed(learner.batches(BATCH), count)
        print(f"streaming, {count} batches of {BATCH} from a server (worker start included), batches/s")
        print(f"  LearnerClient.batches({BATCH}), no torch      {baseline:9.0f}  1.00x")
        for workers in (0, 1, 2):
            dataset = H5ReplayDataset(server.endpoint, BATCH, num_batches=count, timeout=60)
            loader = DataLoader(dataset, batch_size=None, num_workers=workers)
            figure = timed(loader, count)
            print(f"  H5ReplayDataset, num_workers={workers}              {figure:9.0f}  {figure / baseline:.2f}x")
    finally:
        server.stop(timeout=30)


def offline(directory: str, data: dict[str, np.ndarray], images: bool) -> None:
    from h5replay.storage import ReplayBuffer

    rows = len(data["action"])
    path = os.path.join(directory, "local.h5")
    with ReplayBuffer.create(space(images), rows, path) as rb:
        for first in range(0, rows, EPISODE):
            rb.extend({k: v[first:first + EPISODE] for k, v in data.items()})
            rb.end_episode()
    maps = {}
    for name, values in data.items():
        maps[name] = np.lib.format.open_memmap(os.path.join(directory, f"{name}.npy"), "w+", values.dtype, values.shape)
        maps[name][:] = values
    order = np.random.default_rng(1).permutation(rows)
    count = rows // BATCH

    def memmap_batches() -> object:
        for b in range(count):
            ids = np.sort(order[b * BATCH:(b + 1) * BATCH])
            yield {name: torch.from_numpy(m[ids]) for name, m in maps.items()}

    baseline = timed(memmap_batches(), count)
    print(f"offline, one shuffled pass of {rows} rows in batches of {BATCH} from a local file, batches/s")
    print(f"  numpy memmaps, fancy-indexed                 {baseline:9.0f}  1.00x")
    dataset = H5ReplayMapDataset(path)
    for workers in (0, 2):
        figure = timed(dataset.loader(BATCH, shuffle=True, num_workers=workers), count)
        print(f"  H5ReplayMapDataset.loader, num_workers={workers}    {figure:9.0f}  {figure / baseline:.2f}x")
    for workers in (0, 2):
        figure = timed(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers), count)
        print(f"  DataLoader(H5ReplayMapDataset), num_workers={workers} {figure:7.0f}  {figure / baseline:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", action="store_true", help="84x84x3 uint8 observations")
    parser.add_argument("--batches", type=int, default=None, help="streamed batches per figure")
    parser.add_argument("--quick", action="store_true", help="a small buffer and few batches (a smoke test)")
    args = parser.parse_args()
    rows = (4_000 if args.quick else 20_000) if args.images else (10_000 if args.quick else 100_000)
    count = args.batches or (20 if args.quick else (200 if args.images else 1_000))
    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix="h5replay-bench-")
    try:
        data = columns(rows, args.images)
        streaming(directory, data, args.images, count)
        offline(directory, data, args.images)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
