"""Prioritized and removing samplers against a plain Python model (hypothesis state machines).

The model keeps, for every row id held, its priority: the one it was committed with, or the
default (`initial_priority`, else the largest priority given before that commit, starting at
1.0; after a reopen, the largest held), then the last `update_priorities` value. Updates of ids no longer held
are ignored and counted. A row's draw probability is priority ** exponent over the sum for all
rows held; every sample's SampleInfo must say exactly that, and `info()["priority_sum"]` must be
that sum. The priority log is made tiny (8 entries) so checkpoints happen all the time, and the
ring small so rows leave it often; close-and-reopen must keep every priority.

The second machine removes rows: with `max_times_sampled` k, no row is ever returned more than k
times, never twice in one batch, and fifo returns the oldest rows that may still be sampled.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from h5replay.errors import NotEnoughDataError
from h5replay.sampling import Fifo, Prioritized, Uniform
from h5replay.storage import BoxSpace, ReplayBuffer, _sampling_file

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id
PRIORITY = st.one_of(st.none(), st.floats(0.0, 50.0, allow_nan=False), st.sampled_from([0.0, 1e-9, 1e6]))


class PrioritizedMachine(RuleBasedStateMachine):
    """A prioritized buffer against a dict of priorities."""

    @initialize(capacity=st.one_of(st.none(), st.integers(1, 12)), exponent=st.sampled_from([0.0, 0.6, 1.0, 2.5]),
                initial=st.sampled_from([None, 0.5, 3.0]))
    def setup(self, capacity: int | None, exponent: float, initial: float | None) -> None:
        self.dir = tempfile.mkdtemp(prefix="h5r-prio-")
        self.path = os.path.join(self.dir, "b.h5")
        self._log_entries = _sampling_file.LOG_ENTRIES
        _sampling_file.LOG_ENTRIES = 8  # checkpoints every few updates
        self.capacity, self.exponent, self.initial = capacity, exponent, initial
        self.rb = ReplayBuffer.create(SPACE, capacity, self.path, sampler=Prioritized(exponent, initial))
        self.prio: dict[int, float] = {}
        self.max_seen = 1.0
        self.next_id = 0
        self.begin = 0
        self.ignored = 0
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        _sampling_file.LOG_ENTRIES = self._log_entries
        if hasattr(self, "rb"):
            self.rb.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _default(self) -> float:
        return self.initial if self.initial is not None else self.max_seen

    def _evict_to(self, begin: int) -> None:
        for i in range(self.begin, begin):
            self.prio.pop(i, None)
        self.begin = begin

    @rule(priorities=st.lists(PRIORITY, min_size=1, max_size=14))
    def commit(self, priorities: list[float | None]) -> None:
        n = len(priorities)
        if self.capacity is not None and n > self.capacity:
            priorities = priorities[: self.capacity]
            n = self.capacity
        writer = self.rb.open_segment_writer()
        for k, p in enumerate(priorities):
            writer.append(np.int64(self.next_id + k), priority=p)
        receipt = self.rb.commit_segment(writer)
        assert receipt.first_row_id == self.next_id
        default = self._default()
        for k, p in enumerate(priorities):
            self.prio[self.next_id + k] = p if p is not None else default
        self.max_seen = max([self.max_seen, *(p for p in priorities if p is not None)])
        self.next_id += n
        self._evict_to(self.rb.view.begin)  # the ring (and early release) decide; the model follows

    @rule(data=st.data())
    def update(self, data: st.DataObject) -> None:
        if self.next_id == 0:
            return
        ids = data.draw(st.lists(st.integers(0, self.next_id - 1), min_size=0, max_size=10))
        values = data.draw(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=len(ids), max_size=len(ids)))
        ignored = self.rb.update_priorities(np.array(ids, dtype=np.int64), np.array(values))
        expected_ignored = 0
        for i, v in zip(ids, values, strict=True):
            if i in self.prio:
                self.prio[i] = v
                self.max_seen = max(self.max_seen, v)
            else:
                expected_ignored += 1
        assert ignored == expected_ignored
        self.ignored += expected_ignored

    @rule()
    def flush(self) -> None:
        self.rb.flush()

    @rule()
    def clear(self) -> None:
        self.rb.clear()
        self.prio.clear()
        self.begin = self.next_id

    @rule()
    def reopen(self) -> None:
        self.rb.close()
        self.rb = ReplayBuffer.load_from(self.path, read_only=False)
        assert isinstance(self.rb.sampling.sampler, Prioritized)
        assert self.rb.sampling.sampler.exponent == self.exponent
        held = [p for p in self.prio.values()]
        self.max_seen = max([1.0, *held])
        self.ignored = 0

    def _weights(self) -> dict[int, float]:
        return {i: p**self.exponent for i, p in self.prio.items()}

    @invariant()
    def held_rows_match(self) -> None:
        assert self.rb.view.begin == self.begin and self.rb.view.end == self.next_id
        assert set(self.prio) == set(range(self.begin, self.next_id))

    @invariant()
    def probabilities_are_exact(self) -> None:
        weights = self._weights()
        total = sum(weights.values())
        info = self.rb.info()
        assert math.isclose(info["priority_sum"], total, rel_tol=1e-9, abs_tol=1e-9)
        assert info["priority_updates_ignored"] == self.ignored
        if not weights or total <= 0:
            with pytest.raises(NotEnoughDataError):
                self.rb.sample(4, self.rng)
            return
        batch, sample_info = self.rb.sample(32, self.rng, with_info=True)
        ids = sample_info.row_ids.astype(np.int64)
        assert np.array_equal(batch, ids), "each row holds its own id"
        for i, p in zip(ids.tolist(), sample_info.probabilities.tolist(), strict=True):
            assert weights[i] > 0, f"row {i} of weight 0 was drawn"
            assert math.isclose(p, weights[i] / total, rel_tol=1e-9), (i, p, weights[i] / total)


class RemovingMachine(RuleBasedStateMachine):
    """max_times_sampled: rows leave the sampler after k samples; fifo hands out the oldest."""

    @initialize(capacity=st.integers(1, 12), times=st.integers(1, 3), fifo=st.booleans())
    def setup(self, capacity: int, times: int, fifo: bool) -> None:
        self.dir = tempfile.mkdtemp(prefix="h5r-remove-")
        self.path = os.path.join(self.dir, "b.h5")
        self.capacity, self.times, self.fifo = capacity, times, fifo
        self.rb = ReplayBuffer.create(SPACE, capacity, self.path, sampler=Fifo() if fifo else Uniform(),
                                      max_times_sampled=times)
        self.count: dict[int, int] = {}  # held row id -> times sampled
        self.next_id = 0
        self.rng = np.random.default_rng(1)

    def teardown(self) -> None:
        if hasattr(self, "rb"):
            self.rb.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _sync_begin(self) -> None:
        begin = self.rb.view.begin
        for i in list(self.count):
            if i < begin:
                del self.count[i]

    def _sampleable(self) -> list[int]:
        return sorted(i for i, c in self.count.items() if c < self.times)

    @rule(n=st.integers(1, 6))
    def insert(self, n: int) -> None:
        n = min(n, self.capacity)
        self.rb.extend(np.arange(self.next_id, self.next_id + n, dtype=np.int64))
        self.rb.end_episode()
        for i in range(self.next_id, self.next_id + n):
            self.count[i] = 0
        self.next_id += n
        self._sync_begin()

    @rule(n=st.integers(1, 5))
    def sample(self, n: int) -> None:
        sampleable = self._sampleable()
        if n > len(sampleable):
            with pytest.raises(NotEnoughDataError):
                self.rb.sample(n, self.rng)
            return
        batch, info = self.rb.sample(n, self.rng, with_info=True)
        ids = batch.tolist()
        assert ids == info.row_ids.tolist()
        assert len(set(ids)) == n, f"a row twice in one batch: {ids}"
        if self.fifo:
            assert ids == sampleable[:n]
            assert info.probabilities.tolist() == [1.0] * n
        else:  # each pick uniform over the rows still sampleable and not yet in the batch
            expected = [1.0 / (len(sampleable) - k) for k in range(n)]
            assert np.allclose(info.probabilities, expected, rtol=1e-12), (info.probabilities, expected)
        for i in ids:
            assert self.count[i] < self.times, f"row {i} sampled more than {self.times} times"
            self.count[i] += 1
        self._sync_begin()

    @rule()
    def reopen(self) -> None:
        self.rb.close()
        self.rb = ReplayBuffer.load_from(self.path, read_only=False)
        self._sync_begin()

    @invariant()
    def counts(self) -> None:
        info = self.rb.info()
        assert info["sampleable"] == len(self._sampleable())
        head = min(self._sampleable(), default=self.next_id)
        assert self.rb.view.begin <= head, "begin moved past a row that may still be sampled"


PrioritizedMachine.TestCase.settings = RemovingMachine.TestCase.settings = settings(stateful_step_count=25)
TestPrioritizedBuffer = PrioritizedMachine.TestCase
TestRemovingBuffer = RemovingMachine.TestCase
