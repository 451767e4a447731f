"""A sum tree over weights, for prioritized sampling: O(log n) updates and draws, in numpy.

Leaf i holds weight w_i >= 0; every inner node the sum of its two children; the root the total.
Updates and draws take whole arrays at once (one numpy operation per tree level), so a batch of
256 draws or updates costs about as much as one. Pure: no files, no processes.
"""

from __future__ import annotations

import numpy as np

__all__ = ["SumTree"]


class SumTree:
    """Weights of `size` leaves (growable), with prefix-sum draws.

    Leaves live at positions [P, 2P) of one float64 array (P a power of two >= size); node k's
    children are 2k and 2k + 1; node 1 is the root.
    """

    def __init__(self, size: int = 0) -> None:
        self._p = 1
        while self._p < max(1, size):
            self._p *= 2
        self._nodes = np.zeros(2 * self._p, dtype=np.float64)
        self.size = int(size)

    def __len__(self) -> int:
        return self.size

    @property
    def total(self) -> float:
        return float(self._nodes[1])

    def grow(self, size: int) -> None:
        """Hold at least `size` leaves (new ones weigh 0)."""
        if size <= self._p:
            self.size = max(self.size, int(size))
            return
        leaves = self._nodes[self._p : self._p + self.size].copy()
        p = self._p
        while p < size:
            p *= 2
        self._p = p
        self._nodes = np.zeros(2 * p, dtype=np.float64)
        self.size = int(size)
        self._nodes[p : p + leaves.shape[0]] = leaves
        self._rebuild()

    def _rebuild(self) -> None:
        p = self._p
        while p > 1:
            half = p // 2
            self._nodes[half:p] = self._nodes[p : 2 * p : 2] + self._nodes[p + 1 : 2 * p : 2]
            p = half

    def get(self, leaves: np.ndarray) -> np.ndarray:
        """The weights of `leaves` (a copy)."""
        return self._nodes[self._p + np.asarray(leaves, dtype=np.int64)]

    def set(self, leaves: np.ndarray, weights: np.ndarray | float) -> None:
        """Set the weights of `leaves` (for a leaf named twice, the last weight wins)."""
        idx = np.asarray(leaves, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            return
        values = np.broadcast_to(np.asarray(weights, dtype=np.float64), idx.shape)
        self._nodes[self._p + idx] = values  # numpy assigns in order: the last duplicate wins
        # The parents to recompute, level by level: sorted once, then halving keeps them sorted,
        # so equal neighbours are the only duplicates (cheaper than a unique per level).
        nodes = np.sort((self._p + idx) // 2)
        while nodes[0] >= 1:  # node 0 is unused: a tree of one leaf has no parent to update
            if nodes.shape[0] > 1:
                nodes = nodes[np.concatenate(([True], nodes[1:] != nodes[:-1]))]
            self._nodes[nodes] = self._nodes[2 * nodes] + self._nodes[2 * nodes + 1]
            nodes //= 2

    def clear(self) -> None:
        self._nodes[:] = 0.0

    def find(self, targets: np.ndarray) -> np.ndarray:
        """For each target t in [0, total), the leaf i with sum(w[:i]) <= t < sum(w[:i + 1]).

        Never lands on a zero-weight leaf while the total is positive (a target that rounding puts
        on a boundary goes to the side that carries weight).
        """
        targets = np.asarray(targets, dtype=np.float64)
        # The plain descent (a few numpy calls a level); the rare target that rounding leaves on a
        # zero-weight leaf is walked again with the careful rule.
        u = targets.copy()
        node = np.ones(u.shape, dtype=np.int64)
        nodes = self._nodes
        for _ in range(self._p.bit_length() - 1):
            node *= 2
            left = nodes.take(node)
            go_right = u >= left
            u -= left * go_right
            node += go_right
        stray = nodes.take(node) <= 0
        if stray.any():
            node[stray] = self._find_carefully(targets[stray])
        return node - self._p

    def _find_carefully(self, targets: np.ndarray) -> np.ndarray:
        """`find`'s descent (as nodes) that never enters a zero-weight subtree beside a weighted one."""
        u = targets.copy()
        node = np.ones(u.shape, dtype=np.int64)
        nodes = self._nodes
        for _ in range(self._p.bit_length() - 1):
            left = nodes[2 * node]
            go_right = ((u >= left) | (left <= 0)) & (nodes[2 * node + 1] > 0)
            u -= np.where(go_right, left, 0.0)
            node = 2 * node + go_right
        return node

    def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` leaves drawn with probability weight / total (with replacement)."""
        total = self.total
        if total <= 0:
            return np.zeros(0, dtype=np.int64)
        return self.find(rng.random(count) * total)

    def range_sums(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """sum(w[start:stop]) for each pair, through prefix sums of the tree (O(log n) each)."""
        sums: np.ndarray = self.prefix(np.asarray(stops, np.int64)) - self.prefix(np.asarray(starts, np.int64))
        return sums

    def prefix(self, ends: np.ndarray) -> np.ndarray:
        """sum(w[:end]) for each end in [0, size]: climbing from the leaf at `end`, every right
        child passed adds its left sibling, which holds leaves wholly before `end`."""
        full = ends >= self._p
        node = np.where(full, 0, ends) + self._p
        out = np.zeros(ends.shape, dtype=np.float64)
        while np.any(node > 1):
            right_child = (node % 2 == 1) & (node > 1)
            out += np.where(right_child, self._nodes[node - 1], 0.0)
            node = node // 2
        return np.where(full, self.total, out)
