"""What reads and commits report, shared by the storage and the clients (pure: numpy only).

Row ids and episode ids are global: a row's id is its position in the sequence of all rows ever
committed to the file, an episode's id its position among all episodes. Neither ever changes while
the row or episode is held, and neither is ever given to another, across wrap-around, `clear()`,
restarts and crashes.

Over several servers ("shards", see h5replay.client._shards) an id is qualified by the shard it
lives on: the shard's index in the client's `endpoints`. A pair (shard, id) packs into one uint64
as ``shard << 48 | id`` (`pack_ids` / `unpack_ids`): 16 bits of shard, 48 bits of id (2.8e14 rows
per shard). A packed id of shard 0 is the plain id, so ids from a single server are packed ids too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Episode", "Receipt", "SampleInfo", "NO_EPISODE", "SHARD_SHIFT", "pack_ids", "unpack_ids"]

#: The episode id reported for a row that belongs to no recorded episode (rows added with
#: `ReplayBuffer.extend` and not yet ended, or ended with `record=False`).
NO_EPISODE = np.uint64(np.iinfo(np.uint64).max)

#: A packed id is ``shard << SHARD_SHIFT | id``.
SHARD_SHIFT = 48
_ID_MASK = (1 << SHARD_SHIFT) - 1
_MAX_SHARDS = 1 << (64 - SHARD_SHIFT)


def pack_ids(shards: Any, ids: Any) -> np.ndarray:
    """uint64 ids qualified by shard: ``shard << 48 | id`` (arrays broadcast).

    Raises:
        ValueError: a shard index is outside 0..65535, or an id does not fit 48 bits.
    """
    shard = np.asarray(shards, dtype=np.int64)
    local = np.asarray(ids).astype(np.uint64)
    if shard.size and (int(shard.min()) < 0 or int(shard.max()) >= _MAX_SHARDS):
        raise ValueError(f"shard indices must be in 0..{_MAX_SHARDS - 1}, got {int(shard.min())}..{int(shard.max())}")
    if local.size and int(local.max()) > _ID_MASK:
        raise ValueError(f"id {int(local.max())} does not fit the {SHARD_SHIFT} bits of a packed id")
    packed: np.ndarray = (shard.astype(np.uint64) << np.uint64(SHARD_SHIFT)) | local
    return packed


def unpack_ids(packed: Any) -> tuple[np.ndarray, np.ndarray]:
    """(shard indices as int64, ids as uint64) of packed ids."""
    arr = np.asarray(packed).astype(np.uint64)
    return (arr >> np.uint64(SHARD_SHIFT)).astype(np.int64), arr & np.uint64(_ID_MASK)


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
        probabilities: float64, the probability with which each was drawn (over every shard the
            sample drew from).
        shard_ids: int64 index of the shard each row came from (its endpoint's position in a
            learner's `endpoints`); all zeros from a single server.
        has_final: (transitions) bool, whether the row's episode has its final observation
            (None for other samples).
        valid_steps: (padded windows, `sample_sequences(pad=True)`) int64, how many of each
            window's steps are its episode's; the rest are padding (None for other samples).
    """

    row_ids: np.ndarray
    episode_ids: np.ndarray
    probabilities: np.ndarray
    shard_ids: np.ndarray | None = None
    has_final: np.ndarray | None = None
    valid_steps: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.shard_ids is None:  # a single server: every row is of shard 0
            object.__setattr__(self, "shard_ids", np.zeros(self.row_ids.shape[0], dtype=np.int64))

    @property
    def packed_row_ids(self) -> np.ndarray:
        """Row ids qualified by shard (`pack_ids`), as a sharded learner's `get_rows` takes them;
        equal to `row_ids` from a single server."""
        return pack_ids(self.shard_ids, self.row_ids)

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

    def slice(self, start: int, stop: int) -> SampleInfo:
        """The entries [start, stop) (views, not copies)."""
        parts: dict[str, Any] = {name: None if a is None else a[start:stop] for name, a in self._fields().items()}
        return SampleInfo(**parts)

    def concatenate(self, other: SampleInfo) -> SampleInfo:
        """This info followed by `other` (a sample put together from several requests); a field
        that either lacks is left out."""
        theirs = other._fields()
        joined: dict[str, Any] = {name: None if a is None or theirs[name] is None else np.concatenate([a, theirs[name]])
                                  for name, a in self._fields().items()}
        return SampleInfo(**joined)

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
