"""Rows of compressed-image tests: each image is a function of its (episode, step), so any row a
test reads back can be checked bit for bit on its own. Most compress well (a structured patch on
a black frame, as Atari frames do); every 13th is noise, which no codec shrinks, so the raw
fallback and the spill area are met too.

Imported as a plain module (tests/ is on sys.path); the spawned workers of the service tests find
their targets here by module name.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from h5replay.spaces import BoxSpace, DictSpace

IMAGE = (24, 24, 4)
SPACE = DictSpace({
    "episode": BoxSpace(0, 1 << 30, (), np.int32),
    "step": BoxSpace(0, 1 << 20, (), np.int32),
    "obs": DictSpace({"image": BoxSpace(0, 255, IMAGE, np.uint8)}),
})
NOISY_EVERY = 13


def image(episode: int, step: int) -> np.ndarray:
    """The image of step `step` of episode `episode`."""
    rng = np.random.default_rng([int(episode), int(step)])
    if (int(episode) * 7 + int(step)) % NOISY_EVERY == 0:
        return rng.integers(0, 256, IMAGE, dtype=np.uint8)
    out = np.zeros(IMAGE, np.uint8)
    y, x = rng.integers(0, IMAGE[0] - 6, 2)
    out[y : y + 6, x : x + 6] = rng.integers(0, 256, (6, 6, IMAGE[2]), dtype=np.uint8)
    out[0, :, 0] = int(step) % 256
    return out


def episode(episode_id: int, length: int) -> dict[str, Any]:
    steps = np.arange(length, dtype=np.int32)
    return {
        "episode": np.full(length, episode_id, np.int32),
        "step": steps,
        "obs": {"image": np.stack([image(episode_id, int(s)) for s in steps])},
    }


def mismatches(batch: dict[str, Any]) -> list[tuple[int, int]]:
    """(episode, step) of every row of a batch whose image is not the one that was pushed."""
    images = batch["obs"]["image"]
    return [(int(e), int(s)) for e, s, img in zip(batch["episode"], batch["step"], images)
            if not np.array_equal(img, image(int(e), int(s)))]
