"""Recency(half_life): newer rows are likelier, P(row) proportional to 0.5 ** (age / half_life),
age counted in rows from the newest (0) back (DreamerV3's recency selector).

Draws are exact and need no tree: the ages follow a geometric law truncated to the rows held,
drawn by inverting its distribution function; windows are weighted by the age of their first
row, the same law over each episode's window starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.samplers.base import Rows, Sampler, empty, register

__all__ = ["Recency"]


def _truncated_geometric(counts: np.ndarray, log_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """For each count L, a draw b in [0, L) with P(b) proportional to exp(b * log_ratio)."""
    mass = -np.expm1(counts * log_ratio)  # 1 - r ** L
    b = np.floor(np.log1p(-rng.random(counts.shape) * mass) / log_ratio)
    return np.clip(b, 0, counts - 1).astype(np.int64)


@register("recency")
@dataclass(frozen=True)
class Recency(Sampler):
    """Probability proportional to 0.5 ** (age / half_life): a row `half_life` rows older than
    another is half as likely. Exact probabilities; with replacement; rows are never removed."""

    MAY_REMOVE: ClassVar[bool] = False

    half_life: float = 10_000.0

    def __post_init__(self) -> None:
        h = self.half_life
        if isinstance(h, bool) or not isinstance(h, (int, float)) or not math.isfinite(h) or h <= 0:
            raise ConfigError(f"Recency half_life must be a finite number of rows > 0, got {h!r}")

    @property
    def _log_ratio(self) -> float:
        return -math.log(2.0) / float(self.half_life)

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        empty(rows)
        ages = _truncated_geometric(np.full(n, rows.end - rows.begin, np.int64), self._log_ratio, rng)
        ids = rows.end - 1 - ages
        return ids, self.probabilities(rows, ids)

    def probabilities(self, rows: Rows, ids: np.ndarray) -> np.ndarray:
        lr, held = self._log_ratio, rows.end - rows.begin
        ages = (rows.end - 1 - ids).astype(np.float64)
        out: np.ndarray = np.exp(ages * lr) * (-math.expm1(lr)) / (-math.expm1(held * lr))
        return out

    def _episode_weights(self, rows: Rows, starts: np.ndarray, windows: np.ndarray) -> tuple[np.ndarray, float]:
        """Each episode's share of the window weight (normalised), and log of the total weight
        sum over every window start of r ** age, times (1 - r)."""
        lr = self._log_ratio
        with np.errstate(divide="ignore"):
            logs = (rows.end - starts - windows) * lr + np.log(-np.expm1(windows * lr))  # -inf where no window
        if not np.isfinite(logs).any():
            raise NotEnoughDataError(f"no complete episode holds a window of these consecutive rows ({len(windows)} "
                                     "episodes)")
        top = float(logs[np.isfinite(logs)].max())
        shares = np.exp(logs - top)
        total = float(shares.sum())
        return shares / total, top + math.log(total)

    def draw_windows(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, n: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        shares, _ = self._episode_weights(rows, starts, windows)
        k = np.minimum(np.searchsorted(np.cumsum(shares), rng.random(n) * shares.sum(), side="right"), len(shares) - 1)
        k = np.where(windows[k] > 0, k, int(np.argmax(shares)))  # rounding at a share of 0: never such an episode
        back = _truncated_geometric(windows[k], self._log_ratio, rng)
        first = starts[k] + windows[k] - 1 - back
        return first, k, self.window_probabilities(rows, starts, windows, first, k)

    def window_probabilities(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, first: np.ndarray,
                             k: np.ndarray) -> np.ndarray:
        lr = self._log_ratio
        _, log_total = self._episode_weights(rows, starts, windows)
        out: np.ndarray = np.exp((rows.end - 1 - first) * lr + math.log(-math.expm1(lr)) - log_total)
        return out
