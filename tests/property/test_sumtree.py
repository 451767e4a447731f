"""The sum tree against numpy (hypothesis state machine): a plain array of weights, set at
points (duplicates: the last wins) and in ranges, grown, cleared.

After every step: every inner node is exactly the sum its children give (the same as a tree
built afresh from the leaves: updates recompute, they never add deltas, so nothing drifts), the
total matches numpy's, prefix and range sums match, and every target in [0, total) finds a
weighted leaf whose cumulative interval holds it, the same leaf a fresh tree finds (the running
sums a tree keeps for draws follow its changes). Sizes go past 32 ** 2 leaves, so draws and
updates cross three levels.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from h5replay.samplers import sumtree as _sumtree
from h5replay.samplers.sumtree import FANOUT, SumTree

WEIGHTS = st.sampled_from([0.0, 0.0, 1e-300, 1e-9, 0.5, 1.0, 3.0, 1e6, 1e12])


class SumTreeMachine(RuleBasedStateMachine):
    @initialize(size=st.sampled_from([1, 7, FANOUT, FANOUT + 1, 1500]), searched=st.sampled_from([1, 40, 16384]))
    def start(self, size: int, searched: int) -> None:
        # How small a level draws search whole: small values make them descend rows of siblings
        # below it (trees of millions of leaves do), the default searches these trees whole.
        self._saved = _sumtree._SEARCHED
        _sumtree._SEARCHED = searched
        self.tree = SumTree(size)
        self.weights = np.zeros(size)

    def teardown(self) -> None:
        _sumtree._SEARCHED = getattr(self, "_saved", _sumtree._SEARCHED)

    @rule(data=st.data())
    def set_points(self, data: st.DataObject) -> None:
        n = len(self.weights)
        leaves = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=300))
        values = data.draw(st.lists(WEIGHTS, min_size=len(leaves), max_size=len(leaves)))
        self.tree.set(np.array(leaves), np.array(values))
        for leaf, value in zip(leaves, values, strict=True):  # numpy semantics: the last one wins
            self.weights[leaf] = value

    @rule(data=st.data(), value=WEIGHTS)
    def set_range(self, data: st.DataObject, value: float) -> None:
        n = len(self.weights)
        first = data.draw(st.integers(0, n - 1))
        stop = data.draw(st.integers(first, n))
        values = np.full(stop - first, value) * np.linspace(1.0, 2.0, stop - first)
        self.tree.set_range(first, values)
        self.weights[first:stop] = values

    @rule(extra=st.integers(1, 2000))
    def grow(self, extra: int) -> None:
        self.tree.grow(len(self.weights) + extra)
        self.weights = np.concatenate([self.weights, np.zeros(extra)])

    @rule()
    def clear(self) -> None:
        self.tree.clear()
        self.weights[:] = 0.0

    @invariant()
    def inner_nodes_are_their_childrens_sums(self) -> None:
        fresh = SumTree(len(self.weights))
        fresh.set_range(0, self.weights)
        for mine, rebuilt in zip(self.tree._levels, fresh._levels, strict=True):
            assert np.array_equal(mine, rebuilt)

    @invariant()
    def totals_prefixes_and_draws_match_numpy(self) -> None:
        w = self.weights
        assert len(self.tree) == len(w)
        assert self.tree.total == pytest.approx(w.sum(), rel=1e-12, abs=1e-300)
        assert np.array_equal(self.tree.get(np.arange(len(w))), w)
        ends = np.unique(np.linspace(0, len(w), 9).astype(np.int64))
        cum = np.concatenate([[0.0], np.cumsum(w)])
        assert np.allclose(self.tree.prefix(ends), cum[ends], rtol=1e-12, atol=1e-300)
        if self.tree.total <= 0:
            return
        targets = np.concatenate([np.linspace(0.0, self.tree.total, 64), [np.nextafter(self.tree.total, 0.0)]])
        found = self.tree.find(targets)
        fresh = SumTree(len(w))
        fresh.set_range(0, w)
        assert fresh._depth == self.tree._depth
        assert np.array_equal(found, fresh.find(targets)), "the running sums kept for draws are out of date"
        assert np.all(w[found] > 0), "a draw landed on a zero-weight leaf"
        slack = 1e-9 * w.sum()
        assert np.all(cum[found] <= targets + slack) and np.all(targets < cum[found + 1] + slack)


TestSumTree = SumTreeMachine.TestCase
TestSumTree.settings = settings(stateful_step_count=12)
