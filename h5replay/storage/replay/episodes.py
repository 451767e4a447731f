"""The episode table of a replay buffer, in memory: each episode's (first row id, length), in
the ring slots the file keeps them in. Pure numpy.
"""

from __future__ import annotations

import numpy as np

from h5replay.records import NO_EPISODE
from h5replay.storage.replay.ring import Ring

__all__ = ["EpisodeTable", "EPISODE_CHUNK_ROWS"]

EPISODE_CHUNK_ROWS = 4096


class EpisodeTable:
    """The (first row id, length) of episodes [begin, end), in memory, in the file's ring slots.

    Pure numpy. Reads never walk the whole table: `find` and `complete` look at (at most) the two
    contiguous pieces the ring splits it into.
    """

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._ring = Ring(capacity)
        size = min(capacity, EPISODE_CHUNK_ROWS) if capacity is not None else EPISODE_CHUNK_ROWS
        self._starts = np.zeros(size, dtype=np.int64)
        self._lengths = np.zeros(size, dtype=np.int64)
        self.begin = self.end = self.origin = 0
        self._ordered: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.end - self.begin

    def slot(self, episode_id: int) -> int:
        return self._ring.slot(episode_id, self.origin)

    def slots(self, episode_ids: np.ndarray) -> np.ndarray:
        """The slots of several episodes (int64)."""
        slots: np.ndarray = self._ring.slots(episode_ids.astype(np.int64), self.origin)
        return slots

    def _ensure(self, slots: int) -> None:
        if slots > self._starts.shape[0]:
            size = max(slots, 2 * self._starts.shape[0])
            if self.capacity is not None:
                size = min(size, self.capacity)
            self._starts = np.resize(self._starts, size)
            self._lengths = np.resize(self._lengths, size)

    def put(self, episode_id: int, start: int, length: int) -> tuple[int, int]:
        """Record an episode in its slot; returns what the slot held (to undo with `put`)."""
        slot = self.slot(episode_id)
        self._ensure(slot + 1)
        old = (int(self._starts[slot]), int(self._lengths[slot]))
        self._starts[slot], self._lengths[slot] = start, length
        self._ordered = None
        return old

    def put_many(self, first_id: int, records: np.ndarray) -> None:
        """Records (n, 2) for episodes first_id, first_id + 1, ... (at most one ring's worth)."""
        n = records.shape[0]
        if n == 0:
            return
        first = self.slot(first_id)
        size = first + n if self.capacity is None else self.capacity
        self._ensure(first + n if self.capacity is None else min(self.capacity, first + n))
        head = min(n, size - first)
        self._starts[first : first + head], self._lengths[first : first + head] = records[:head, 0], records[:head, 1]
        if head < n:
            self._starts[: n - head], self._lengths[: n - head] = records[head:, 0], records[head:, 1]
        self._ordered = None

    def set_range(self, begin: int, end: int) -> None:
        if (begin, end) != (self.begin, self.end):
            self.begin, self.end = begin, end
            self._ordered = None

    def start_of(self, episode_id: int) -> int:
        return int(self._starts[self.slot(episode_id)])

    def length_of(self, episode_id: int) -> int:
        return int(self._lengths[self.slot(episode_id)])

    def first_with_rows_from(self, row_begin: int) -> int:
        """The first episode id >= self.begin that still has a row at or after `row_begin`."""
        e = self.begin
        while e < self.end and self.start_of(e) + self.length_of(e) <= row_begin:
            e += 1
        return e

    def _pieces(self) -> list[tuple[int, int, int]]:
        """(first episode id, first slot, count) of the contiguous runs of [begin, end)."""
        return [(id0, s0, s1 - s0) for s0, s1, id0 in self._ring.pieces(self.begin, self.end, self.origin)]

    def ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(episode ids, first row ids, lengths) of [begin, end), oldest first (cached)."""
        if self._ordered is None:
            pieces = self._pieces()
            ids = np.arange(self.begin, self.end, dtype=np.int64)
            if len(pieces) <= 1:
                sl = slice(pieces[0][1], pieces[0][1] + pieces[0][2]) if pieces else slice(0, 0)
                starts, lengths = self._starts[sl].copy(), self._lengths[sl].copy()
            else:
                starts = np.concatenate([self._starts[s : s + c] for _, s, c in pieces])
                lengths = np.concatenate([self._lengths[s : s + c] for _, s, c in pieces])
            self._ordered = (ids, starts, lengths)
        return self._ordered

    def complete(self, row_begin: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`ordered()` without a first episode that lost its head (first row id < row_begin)."""
        ids, starts, lengths = self.ordered()
        if starts.shape[0] and starts[0] < row_begin:
            return ids[1:], starts[1:], lengths[1:]
        return ids, starts, lengths

    def find(self, row_ids: np.ndarray) -> np.ndarray:
        """The episode id of each row (NO_EPISODE for rows outside every recorded episode)."""
        return self.locate(row_ids)[0]

    def locate(self, row_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(episode id, its first row id, its length) of each row; (NO_EPISODE, the row, 1)
        for rows outside every recorded episode."""
        out = np.full(row_ids.shape, NO_EPISODE, dtype=np.uint64)
        rows = row_ids.astype(np.int64, copy=False)
        first_rows, lengths_of = rows.copy(), np.ones(rows.shape, dtype=np.int64)
        for first_id, slot, count in self._pieces():
            starts = self._starts[slot : slot + count]
            lengths = self._lengths[slot : slot + count]
            k = np.searchsorted(starts, rows, side="right") - 1
            inside = k >= 0
            kk = np.where(inside, k, 0)
            inside &= rows < starts[kk] + lengths[kk]
            out[inside] = (first_id + kk[inside]).astype(np.uint64)
            first_rows[inside], lengths_of[inside] = starts[kk[inside]], lengths[kk[inside]]
        return out, first_rows, lengths_of
