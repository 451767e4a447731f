"""Uniform(): every row held is equally likely (with replacement); windows too."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from h5replay.errors import NotEnoughDataError
from h5replay.samplers.base import Rows, Sampler, empty, register, without_replacement

__all__ = ["Uniform", "uniform_windows"]


def uniform_windows(starts: np.ndarray, windows: np.ndarray, steps: int | None, n: int,
                    rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n windows, each of every window start equally likely."""
    count = int(windows.sum())
    if count == 0:
        raise NotEnoughDataError(f"no complete episode holds a window of {steps or 'these'} consecutive rows "
                                 f"({len(windows)} episodes)")
    ends = np.cumsum(windows)
    r = rng.integers(0, count, size=n, dtype=np.int64)
    k = np.searchsorted(ends, r, side="right")
    return starts[k] + (r - (ends[k] - windows[k])), k, np.full(n, 1.0 / count)


@register("uniform")
@dataclass(frozen=True)
class Uniform(Sampler):
    """Every row held is equally likely (with replacement); with max_times_sampled, every row
    that may still be sampled, without replacement."""

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        empty(rows)
        if rows.removing:
            return without_replacement(rows, n, rng)
        ids = rng.integers(rows.begin, rows.end, size=n, dtype=np.int64)
        return ids, np.full(n, 1.0 / (rows.end - rows.begin))

    def probabilities(self, rows: Rows, ids: np.ndarray) -> np.ndarray:
        return np.full(ids.shape, 1.0 / (rows.end - rows.begin))

    def draw_windows(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, n: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return uniform_windows(starts, windows, None, n, rng)

    def window_probabilities(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, first: np.ndarray,
                             k: np.ndarray) -> np.ndarray:
        return np.full(first.shape, 1.0 / max(1, int(windows.sum())))
