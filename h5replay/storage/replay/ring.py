"""Where an id lives: the arithmetic of a ring of slots, in one place.

Rows and episodes have global ids that never move (0, 1, 2, ...: their place among all ever
committed). A fixed-capacity buffer keeps id `i` in slot `i % capacity`; an unbounded one keeps it
in slot `i - origin`, where `origin` is the id at slot 0 (it moves on `clear()`). The rows and the
episode table are both such rings, each with its own origin. Pure: ints and numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from h5replay.errors import EvictedError
from h5replay.storage.replay.state import State

__all__ = ["Ring", "as_row_ids", "check_held"]


@dataclass(frozen=True)
class Ring:
    """Slots of a ring of `capacity` (None: an unbounded table, slots from `origin`)."""

    capacity: int | None

    def slot(self, id_: int, origin: int = 0) -> int:
        """The slot of one id."""
        return id_ % self.capacity if self.capacity is not None else id_ - origin

    def slots(self, ids: Any, origin: int = 0) -> Any:
        """The slots of ids (an int, or an array of them)."""
        return ids % self.capacity if self.capacity is not None else ids - origin

    def ids(self, slots: np.ndarray, begin: int, origin: int = 0) -> np.ndarray:
        """The ids held in `slots`, the oldest held being `begin` (the inverse of `slots` over
        the ids [begin, begin + capacity))."""
        if self.capacity is None:
            return slots + origin
        return begin + (slots - begin % self.capacity) % self.capacity

    def pieces(self, first: int, stop: int, origin: int = 0) -> list[tuple[int, int, int]]:
        """(first slot, stop slot, first id) of the contiguous runs the ids [first, stop) take:
        one, or two where the ring wraps (never more than one ring's worth)."""
        n = stop - first
        if n <= 0:
            return []
        if self.capacity is None:
            s = first - origin
            return [(s, s + n, first)]
        n = min(n, self.capacity)
        s = first % self.capacity
        head = min(n, self.capacity - s)
        out = [(s, s + head, first)]
        if head < n:
            out.append((0, n - head, first + head))
        return out


def as_row_ids(row_ids: Any) -> np.ndarray:
    """Row ids as a 1-D int64 array, or TypeError / IndexError naming what is wrong with them."""
    arr = np.asarray(row_ids) if not isinstance(row_ids, np.ndarray) else row_ids
    if arr.dtype.kind not in "iu" or (arr.size == 0 and arr.dtype == object):
        if arr.size == 0 and arr.dtype.kind == "f":
            return np.zeros(0, dtype=np.int64)
        raise TypeError(f"row ids must be integers, got {arr.dtype}")
    flat = arr.reshape(-1)
    if flat.size and arr.dtype.kind == "u" and int(flat.max()) > np.iinfo(np.int64).max:
        raise IndexError(f"row id {int(flat.max())} was never committed")
    ids = flat.astype(np.int64, copy=False)
    if ids.size and int(ids.min()) < 0:
        raise IndexError(f"row id {int(ids.min())} is negative; row ids count from 0")
    return ids


def check_held(ids: np.ndarray, view: State) -> int:
    """The lowest of `ids` (not empty), all held in `view`.

    Raises:
        EvictedError: an id is no longer held (names the first).
        IndexError: an id was never committed.
    """
    lo, hi = int(ids.min()), int(ids.max())
    if lo < view.begin:
        first = int(ids[np.argmax(ids < view.begin)])
        raise EvictedError(f"row id {first} is no longer held: the buffer holds ids [{view.begin}, {view.end})")
    if hi >= view.end:
        raise IndexError(f"row id {hi} was never committed: the next row id is {view.end}")
    return lo
