"""What reads and commits report, shared by the storage and the clients (pure: numpy only).

Row ids and episode ids are global: a row's id is its position in the sequence of all rows ever
committed to the file, an episode's id its position among all episodes. Neither ever changes while
the row or episode is held, and neither is ever given to another, across wrap-around, `clear()`,
restarts and crashes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

__all__ = ["Episode", "Receipt", "SampleInfo", "NO_EPISODE"]

#: The episode id reported for a row that belongs to no recorded episode (rows added with
#: `ReplayBuffer.extend` and not yet ended, or ended with `record=False`).
NO_EPISODE = np.uint64(np.iinfo(np.uint64).max)


class Receipt(NamedTuple):
    """What a commit placed: the episode's id, its first row's id, and its number of rows.
    An empty episode records nothing and gives Receipt(-1, -1, 0)."""

    episode_id: int
    first_row_id: int
    length: int


class Episode(NamedTuple):
    """A complete episode held: its id, the id of its first row, and its number of rows."""

    episode_id: int
    first_row_id: int
    length: int


@dataclass(frozen=True)
class SampleInfo:
    """What a sample returned, one entry per sampled row (per window for sequences).

    Attributes:
        row_ids: uint64 global ids of the rows (of each window's first row).
        episode_ids: uint64 ids of their episodes (NO_EPISODE for a row outside any episode).
        probabilities: float64, the probability with which each was drawn.
    """

    row_ids: np.ndarray
    episode_ids: np.ndarray
    probabilities: np.ndarray

    def __len__(self) -> int:
        return int(self.row_ids.shape[0])

    def importance_weights(self, beta: float) -> np.ndarray:
        """Importance-sampling weights (N * P(i)) ** -beta, normalised by their maximum (Schaul
        et al. 2016), where N = 1 / P for a uniform draw; all ones for a uniform sample.

        Raises:
            ValueError: `beta` is not in [0, 1].
        """
        if not 0.0 <= float(beta) <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta!r}")
        if not len(self):
            return np.zeros(0, dtype=np.float64)
        weights: np.ndarray = np.power(self.probabilities, -float(beta))
        return weights / weights.max()  # type: ignore[no-any-return]

    def concatenate(self, other: SampleInfo) -> SampleInfo:
        """This info followed by `other` (a sample put together from several requests)."""
        return SampleInfo(
            np.concatenate([self.row_ids, other.row_ids]),
            np.concatenate([self.episode_ids, other.episode_ids]),
            np.concatenate([self.probabilities, other.probabilities]),
        )
