"""Lossless codecs on real Atari frames: the measurements a compressed image column is chosen by.

    .venv-frames/bin/python benchmarks/frames.py            # about a minute
    .venv-frames/bin/python benchmarks/frames.py --frames 2000 --games Pong

Frames come from gymnasium's ALE environments (`ale-py` ships the ROMs), a random policy,
preprocessed as DQN does: 84x84 grey (AtariPreprocessing), and the 84x84x4 stack of the last four
(FrameStackObservation) that a DQN replay stores per step. For each codec, per row (one frame or
one stack, compressed alone, as a row of a ring would be): bytes on disk as a ratio to raw, the
largest and the 99th percentile compressed size (what a fixed slot per row must hold), and
encode / decode speed as a ratio to a plain copy of the same bytes measured in the same run.
Every row is decoded and compared with the original (lossless or the run fails).

Codecs: zstd (the `zstandard` package) at levels 1, 3, 9; LZ4 (`lz4.block`); Blosc2 with zstd and
LZ4 and its byte shuffle (`blosc2`); and zstd over the difference to the previous frame of the
episode (a frame trick: rows then depend on their neighbour). Needs the optional packages:
`python -m venv .venv-frames && .venv-frames/bin/pip install -e . ale-py gymnasium zstandard lz4 blosc2`.
Never part of `make test`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

Codec = tuple[Callable[[np.ndarray], bytes], Callable[[bytes, np.ndarray], np.ndarray]]


def frames_of(game: str, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` preprocessed frames (84x84 grey) and stacks (84x84x4) of `game`, a random policy."""
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1, repeat_action_probability=0.25)
    env = gym.wrappers.AtariPreprocessing(env, frame_skip=4, screen_size=84, grayscale_obs=True)
    env = gym.wrappers.FrameStackObservation(env, 4)
    rng = np.random.default_rng(seed)
    stacks = np.empty((count, 4, 84, 84), np.uint8)
    obs, _ = env.reset(seed=seed)
    for i in range(count):
        stacks[i] = obs
        obs, _, terminated, truncated, _ = env.step(int(rng.integers(env.action_space.n)))
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return np.ascontiguousarray(stacks[:, -1]), np.ascontiguousarray(stacks.transpose(0, 2, 3, 1))


def codecs() -> dict[str, Codec]:
    import blosc2
    import lz4.block
    import zstandard

    made: dict[str, Codec] = {}
    for level in (1, 3, 9):
        cctx, dctx = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        made[f"zstd {level}"] = (cctx.compress, lambda b, like, d=dctx: np.frombuffer(d.decompress(b), like.dtype))
    made["lz4"] = (lambda a: lz4.block.compress(a.tobytes(), store_size=True),
                   lambda b, like: np.frombuffer(lz4.block.decompress(b), like.dtype))
    for name, codec in (("zstd", blosc2.Codec.ZSTD), ("lz4", blosc2.Codec.LZ4)):
        params = {"codec": codec, "clevel": 5, "filter": blosc2.Filter.SHUFFLE, "typesize": 1}
        made[f"blosc2 {name}"] = (lambda a, p=params: blosc2.compress(a.tobytes(), **p),
                                  lambda b, like: np.frombuffer(blosc2.decompress(b), like.dtype))
    return made


def measure(rows: np.ndarray, codec: Codec, delta: bool = False) -> dict[str, Any]:
    """Sizes and speeds of `codec` over `rows`, each alone (with `delta`: its difference to the
    previous row, wrapping in uint8); checks every decoded row."""
    encode, decode = codec
    source = rows if not delta else np.concatenate([rows[:1], rows[1:] - rows[:-1]])
    t0 = time.perf_counter()
    blobs = [encode(np.ascontiguousarray(row)) for row in source]
    t1 = time.perf_counter()
    decoded = [decode(blob, row) for blob, row in zip(blobs, source)]
    t2 = time.perf_counter()
    back = np.stack([d.reshape(rows.shape[1:]) for d in decoded])
    if delta:
        back = np.cumsum(back, axis=0, dtype=np.uint8)
    if not np.array_equal(back, rows):
        raise SystemExit("a codec returned other bytes than it was given: not lossless")
    sizes = np.array([len(b) for b in blobs])
    return {"bytes": float(sizes.mean()), "max": int(sizes.max()), "p99": float(np.percentile(sizes, 99)),
            "encode_s": t1 - t0, "decode_s": t2 - t1}


def copy_seconds(rows: np.ndarray) -> float:
    """A plain copy of each row, in the same loop shape: the speed baseline."""
    t0 = time.perf_counter()
    for row in rows:
        row.copy()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=5000, help="frames per game")
    parser.add_argument("--games", default="Pong,Breakout", help="ALE games, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        made = codecs()
    except ImportError as exc:
        print(f"needs the optional packages ({exc}); see the module docstring", file=sys.stderr)
        return 2
    for game in args.games.split(","):
        grey, stacks = frames_of(game, args.frames, args.seed)
        for what, rows in (("84x84 grey frame", grey), ("84x84x4 stack", stacks)):
            raw = rows[0].nbytes
            copy_seconds(rows)
            base = copy_seconds(rows)
            print(f"\n{game}, {what} ({raw} bytes raw), {len(rows)} rows each compressed alone; "
                  f"speeds as a ratio to a copy of the same rows ({raw * len(rows) / base / 1e9:.1f} GB/s):")
            print(f"  {'codec':<14} {'ratio':>7} {'bytes/row':>10} {'p99':>7} {'max':>7} {'max/raw':>8} "
                  f"{'encode':>8} {'decode':>8} {'enc MB/s':>9} {'dec MB/s':>9}")
            cases = [(name, codec, False) for name, codec in made.items()]
            cases.append(("zstd 3, delta", made["zstd 3"], True))
            for name, codec, delta in cases:
                measure(rows[:300], codec, delta)  # warm-up, untimed: allocators, first calls
                m = measure(rows, codec, delta)
                total = raw * len(rows)
                print(f"  {name:<14} {raw / m['bytes']:>6.1f}x {m['bytes']:>10.0f} {m['p99']:>7.0f} {m['max']:>7d} "
                      f"{m['max'] / raw:>8.2f} {base / m['encode_s']:>7.3f}x {base / m['decode_s']:>7.3f}x "
                      f"{total / m['encode_s'] / 1e6:>9.0f} {total / m['decode_s'] / 1e6:>9.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
