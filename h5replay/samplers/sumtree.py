"""A sum tree over weights, for prioritized sampling: a wide (B-ary) tree of numpy levels.

Leaf i holds weight w_i >= 0; every inner node the sum of its B children; the root the total.
With B = 32 a million leaves need 4 levels above them, so an update or a draw of a whole batch
costs a few numpy calls per level, not per leaf (a binary tree needs 20 levels). A node is always
recomputed from its children (never adjusted by a delta), so the sums carry no drift and the tree
equals one built afresh from its leaves. Draws read running sums along each row of siblings,
kept beside the levels and brought up to date, for the rows that changed, by the next draw:
updates pay nothing for them, and draws between two updates share the work. Pure: no files, no
processes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree", "FANOUT"]

FANOUT = 32  # children per node: 32 * 8 bytes, a row of siblings fits in four cache lines
_SEARCHED = 16384  # a level this small is searched whole by draws (its running sum, kept, costs little)


def _row_sums(rows: np.ndarray) -> np.ndarray:
    """The sum of each row of B siblings. einsum's kernel adds a row in the same order whatever the
    rows around it, so a node comes out the same recomputed alone or with its whole level, and at
    a third of the cost of `sum(axis=1)` on rows this short."""
    sums: np.ndarray = np.einsum("ij->i", rows)
    return sums


def _rows(n: int) -> int:
    """Nodes of the level above `n` nodes (every one has B child slots)."""
    return -(-n // FANOUT)


class SumTree:
    """Weights of `size` leaves (growable), with prefix-sum draws.

    `levels[0]` holds the leaves, `levels[-1]` the root alone; node k of level j + 1 holds the
    sum of `levels[j][k * B : (k + 1) * B]`. Each level below the root is zero-padded to a
    multiple of B, so `levels[j].reshape(-1, B)` lines every node's children up as a row.
    Draws descend from the first level of at most _SEARCHED nodes (`depth`): the sums of its
    nodes before each node (`_before`, one longer than the level), and below it each level's
    running sums within rows (`_sums`), which `_stale` says which rows of are out of date
    (None: all of them).
    """

    def __init__(self, size: int = 0) -> None:
        self.size = int(size)
        self._reset(max(1, self.size))

    def _reset(self, size: int) -> None:
        levels = []
        n = size
        while True:
            levels.append(np.zeros(_rows(n) * FANOUT, dtype=np.float64))
            n = _rows(n)
            if n == 1:
                levels.append(np.zeros(1, dtype=np.float64))
                break
        self._levels = levels
        self._depth = next(j for j, level in enumerate(levels) if level.shape[0] <= _SEARCHED)
        self._sums = [np.zeros_like(level) for level in levels[: self._depth]]
        self._before = np.zeros(levels[self._depth].shape[0] + 1)
        self._stale: list[list[np.ndarray]] | None = None
        self._stale_rows = 0  # rows of leaves listed in _stale (past a quarter of them: all)

    def __len__(self) -> int:
        return self.size

    @property
    def total(self) -> float:
        return float(self._levels[-1][0])

    def grow(self, size: int) -> None:
        """Hold at least `size` leaves (new ones weigh 0)."""
        if size <= self._levels[0].shape[0]:
            self.size = max(self.size, int(size))
            return
        leaves = self._levels[0][: self.size]
        self._reset(int(size))
        self._levels[0][: leaves.shape[0]] = leaves
        self.size = int(size)
        self._rebuild(0, self._levels[0].shape[0])

    def _rebuild(self, first: int, stop: int) -> None:
        """Recompute every ancestor of leaves [first, stop) (a contiguous run)."""
        for j, (below, above) in enumerate(zip(self._levels, self._levels[1:])):
            first, stop = first // FANOUT, _rows(stop)
            above[first:stop] = _row_sums(below[first * FANOUT : stop * FANOUT].reshape(-1, FANOUT))
            self._mark(j, np.arange(first, stop))

    def _mark(self, level: int, rows: np.ndarray) -> None:
        """Rows of `level` whose running sums are out of date. Past a quarter of the leaves' rows
        (a writer that updates and seldom draws), all of them: one pass over them costs as much."""
        if self._stale is None or level >= self._depth:
            return
        self._stale[level].append(rows)
        if level == 0:
            self._stale_rows += rows.shape[0]
            if 4 * self._stale_rows > self._levels[0].shape[0] // FANOUT:
                self._stale = None

    def get(self, leaves: np.ndarray) -> np.ndarray:
        """The weights of `leaves` (a copy)."""
        return self._levels[0][np.asarray(leaves, dtype=np.int64)]

    def set(self, leaves: np.ndarray, weights: np.ndarray | float) -> None:
        """Set the weights of `leaves` (for a leaf named twice, the last weight wins)."""
        idx = np.asarray(leaves, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return
        self._levels[0][idx] = weights  # numpy assigns in order: the last duplicate wins
        # The parents to recompute, level by level, each from its B children. Sorted once, the
        # parents stay sorted as they climb, so equal neighbours are the only duplicates; the
        # ones left (a parent recomputed twice gets the same sum twice) are harmless.
        nodes = np.sort(idx // FANOUT)
        for j, (below, above) in enumerate(zip(self._levels, self._levels[1:])):
            if nodes.shape[0] > 8:
                first = np.empty(nodes.shape[0], dtype=bool)
                first[0] = True
                np.not_equal(nodes[1:], nodes[:-1], out=first[1:])
                nodes = nodes[first]
            above[nodes] = _row_sums(below.reshape(-1, FANOUT).take(nodes, axis=0))
            self._mark(j, nodes.copy())
            nodes //= FANOUT

    def set_range(self, first: int, weights: np.ndarray | float, count: int | None = None) -> None:
        """Set the weights of leaves [first, first + n) (n: len(weights), or `count` for a scalar)."""
        n = int(count) if count is not None else int(np.shape(weights)[0])
        if n <= 0:
            return
        self._levels[0][first : first + n] = weights
        self._rebuild(first, first + n)

    def clear(self) -> None:
        for level in self._levels:
            level[:] = 0.0
        self._stale = None

    def _refresh(self) -> None:
        """Bring the running sums draws read up to date (only the rows changed since the last)."""
        if self._stale is None:
            for level, sums in zip(self._levels, self._sums):
                np.cumsum(level.reshape(-1, FANOUT), axis=1, out=sums.reshape(-1, FANOUT))
            changed = True
        else:
            changed = False
            for level, sums, stale in zip(self._levels, self._sums, self._stale):
                if stale:
                    rows = np.concatenate(stale) if len(stale) > 1 else stale[0]
                    sums.reshape(-1, FANOUT)[rows] = np.cumsum(level.reshape(-1, FANOUT)[rows], axis=1)
                    changed = True
        if changed or self._depth == 0:
            np.cumsum(self._levels[self._depth], out=self._before[1:])
        self._stale = [[] for _ in self._sums]
        self._stale_rows = 0

    def find(self, targets: np.ndarray) -> np.ndarray:
        """For each target t in [0, total), the leaf i with sum(w[:i]) <= t < sum(w[:i + 1]).

        Never lands on a zero-weight leaf while the total is positive: at each step the node
        taken is the first whose running sum exceeds t, so it carries weight; a target that
        rounding puts at or past a sum goes to the last weighted node there.
        """
        self._refresh()
        return self._descend(np.array(targets, dtype=np.float64, copy=True).reshape(-1))

    def _descend(self, u: np.ndarray) -> np.ndarray:
        """`find` for targets `u` (consumed: reduced to the remainder at each level)."""
        level, before = self._levels[self._depth], self._before
        node = np.searchsorted(before[1:], u, side="right")
        if node.shape[0] and int(node.max()) >= level.shape[0]:  # rounding: t at or past the total
            past = node >= level.shape[0]
            node[past] = int(np.flatnonzero(level > 0)[-1]) if before[-1] > 0 else 0
        u -= before.take(node)
        n = u.shape[0]
        # Each row: 0, then the running sums of one node's children; so the sum before child c
        # is entry c, and the remainder takes one `take` (fewer numpy calls than a `where`).
        rows = np.empty((n, FANOUT + 1))
        rows[:, 0] = 0.0
        starts = np.arange(n, dtype=np.int64) * (FANOUT + 1)
        for j in reversed(range(self._depth)):
            sums = self._sums[j].reshape(-1, FANOUT).take(node, axis=0)  # (n, B)
            rows[:, 1:] = sums
            child = np.argmax(sums > u[:, None], axis=1)
            past = sums[:, -1] <= u
            if past.any():  # rounding: t at or past the row's sum; take the last weighted child
                weights = self._levels[j].reshape(-1, FANOUT)[node[past]]
                child[past] = FANOUT - 1 - np.argmax(weights[:, ::-1] > 0, axis=1)
            u -= rows.reshape(-1).take(starts + child)
            node = node * FANOUT + child
        return node

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` leaves drawn with probability weight / total (with replacement)."""
        total = self.total
        if total <= 0:
            return np.zeros(0, dtype=np.int64)
        self._refresh()
        return self._descend(rng.random(count) * total)

    def range_sums(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """sum(w[start:stop]) for each pair, through prefix sums of the tree."""
        sums: np.ndarray = self.prefix(np.asarray(stops, np.int64)) - self.prefix(np.asarray(starts, np.int64))
        return sums

    def prefix(self, ends: np.ndarray) -> np.ndarray:
        """sum(w[:end]) for each end in [0, size]: climbing from the leaf at `end`, each level adds
        the siblings to the left of the node passed, which hold leaves wholly before `end`."""
        ends = np.asarray(ends, dtype=np.int64).reshape(-1)
        full = ends >= self._levels[0].shape[0]
        pos = np.where(full, 0, ends)
        out = np.zeros(ends.shape, dtype=np.float64)
        flat_base = np.arange(ends.shape[0], dtype=np.int64) * FANOUT
        for level in self._levels[:-1]:
            row, offset = pos // FANOUT, pos % FANOUT
            sums = np.cumsum(level.reshape(-1, FANOUT)[row], axis=1)
            out += np.where(offset > 0, sums.reshape(-1).take(flat_base + offset - 1), 0.0)
            pos = row
        return np.where(full, self.total, out)
