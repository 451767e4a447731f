"""Prioritized and removing samplers against a plain Python model (hypothesis state machines).

The model keeps, for every row id held, its priority: the one it was committed with, or the
default (`initial_priority`, else the largest priority given before that commit, starting at
1.0, kept across reopens and crashes as of the last publish), then the last `update_priorities`
value. Updates of ids no longer held are ignored and counted. A row's draw probability is
priority ** exponent over the sum for all rows held; every sample's SampleInfo must say exactly
that, and `info()["priority_sum"]` must be that sum. The priority log is made tiny (8 entries) so
checkpoints happen all the time, and the ring small so rows leave it often; close-and-reopen must
keep every priority and the running maximum. A crash (the file closed without the state row of a
publish, or of the publish under way) must come back exactly as of the last publish: the commits
(each published) and the first `plog` logged updates, never an update no publish counted. A
priority whose weight would pass `MAX_WEIGHT` is refused, by every way in, and changes nothing.

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

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.sampling import Fifo, Prioritized, Uniform
from h5replay.storage import BoxSpace, ReplayBuffer
from h5replay.storage.replay import table_file as _sampling_file

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id
PRIORITY = st.one_of(st.none(), st.floats(0.0, 50.0, allow_nan=False), st.sampled_from([0.0, 1e-9, 1e6]))


class _Killed(Exception):
    """The writer process died here (raised by a publish cut short before its state row)."""


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
        self.committed: dict[int, float] = {}  # row id -> its priority at commit (every commit is published)
        self.given: list[float] = []  # every priority given at a commit
        self.log: list[tuple[int, float]] = []  # every update of a held row, in order: the buffer's log
        self.limit = Prioritized(exponent).priority_limit
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
            self.prio[self.next_id + k] = self.committed[self.next_id + k] = p if p is not None else default
        self.given += [p for p in priorities if p is not None]
        self.max_seen = max([self.max_seen, *(p for p in priorities if p is not None)])
        self.next_id += n
        self._evict_to(self.rb.view.begin)  # the ring (and early release) decide; the model follows

    @rule(data=st.data())
    def update(self, data: st.DataObject) -> None:
        if self.next_id == 0:
            return
        ids = data.draw(st.lists(st.integers(0, self.next_id - 1), min_size=0, max_size=10))
        value = st.floats(0.0, 100.0, allow_nan=False)
        if math.isfinite(self.limit):  # now and then the largest priority allowed
            value = value | st.just(self.limit)
        values = data.draw(st.lists(value, min_size=len(ids), max_size=len(ids)))
        ignored = self.rb.update_priorities(np.array(ids, dtype=np.int64), np.array(values))
        expected_ignored = 0
        for i, v in zip(ids, values, strict=True):
            if i in self.prio:
                self.prio[i] = v
                self.log.append((i, v))
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
        self.ignored = 0  # the running maximum and every priority stay (see the invariants)

    @rule(mid_publish=st.booleans())
    def crash(self, mid_publish: bool) -> None:
        """The writer dies: what it wrote reaches the file, but not the state row of a publish
        under way (`mid_publish`: its log entries and running maximum are written), nor any after."""
        if mid_publish:
            journal, storage = self.rb._journal, self.rb.storage

            def dying(state: object, fsync: bool = False) -> None:
                journal.write_records()  # type: ignore[union-attr]
                storage.flush()
                raise _Killed

            journal.publish = dying  # type: ignore[method-assign, union-attr]
            with pytest.raises(_Killed):
                self.rb.flush()
        self._recover()

    @rule(values=st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=12, max_size=12))
    def crash_in_a_checkpoint(self, values: list[float]) -> None:
        """The writer dies in a checkpoint, right after it wrote the priorities dataset: updates
        of 4 entries until one needs a checkpoint (the log holds 8)."""
        if not self.prio:
            return
        sampling = self.rb._sampling
        checkpoint = sampling.checkpoint

        def dying() -> None:
            checkpoint()
            raise _Killed

        sampling.checkpoint = dying  # type: ignore[method-assign]
        ids = sorted(self.prio)
        with pytest.raises(_Killed):
            for call in range(3):
                entries = [(ids[(4 * call + k) % len(ids)], values[4 * call + k]) for k in range(4)]
                self.log += entries  # in the log once applied (the kill may come first: see _recover)
                self.rb.update_priorities([i for i, _ in entries], [v for _, v in entries])
        self._recover()

    def _recover(self) -> None:
        """Reopen after a crash; the model as of the last publish the file shows."""
        self.rb.storage.close()  # flushes what HDF5 holds; the state row stays the last published
        self.rb.close()  # publishes nothing: its storage is closed
        self.rb = ReplayBuffer.load_from(self.path, read_only=False)
        published = self.rb.published.tables[0].plog
        assert published <= len(self.log), "the file counts updates never made"
        del self.log[published:]  # lost: applied after the last publish (or never)
        self.prio = {i: self.committed[i] for i in range(self.begin, self.next_id)}
        for i, v in self.log:
            if i in self.prio:
                self.prio[i] = v
        self.max_seen = max([1.0, *self.given, *(v for _, v in self.log)])
        self.ignored = 0

    @rule(data=st.data(), way=st.sampled_from(["update", "append", "extend", "writer", "storage_writer"]))
    def huge_priority_refused(self, data: st.DataObject, way: str) -> None:
        """A priority whose weight would pass MAX_WEIGHT is refused (naming the bound), whichever
        way it comes in; nothing changes (the invariants check the priorities and the maximum)."""
        if not math.isfinite(self.limit):
            return  # exponent 0: every weight is 1
        huge = data.draw(st.sampled_from([float(np.nextafter(self.limit, math.inf)), 1.7e308, self.limit * 10]))
        before = self.rb.published
        with pytest.raises(ConfigError, match="would exceed 1e\\+280"):
            if way == "update":
                if self.next_id == 0:
                    raise ConfigError("would exceed 1e+280 (nothing held to update)")
                self.rb.update_priorities([self.next_id - 1, self.next_id - 1], [1.0, huge])
            elif way == "append":
                self.rb.append(np.int64(self.next_id), priority=huge)
            elif way == "extend":
                self.rb.extend(np.arange(self.next_id, self.next_id + 2), priorities=[0.5, huge])
            elif way == "writer":
                with self.rb.open_segment_writer() as writer:
                    writer.append(np.int64(self.next_id), priority=1.0)
                    writer.append(np.int64(self.next_id + 1), priority=huge)
            else:  # a writer of the storage itself knows no sampler: refused at commit, left open
                writer = self.rb.storage.open_segment_writer()
                writer.append(np.int64(self.next_id), priority=huge)
                try:
                    self.rb.commit_segment(writer)
                finally:
                    assert writer.state == "open"
                    writer.abort()
        assert self.rb.published == before and self.rb.view.end == self.next_id

    def _weights(self) -> dict[int, float]:
        return {i: p**self.exponent for i, p in self.prio.items()}

    @invariant()
    def held_rows_match(self) -> None:
        assert self.rb.view.begin == self.begin and self.rb.view.end == self.next_id
        assert set(self.prio) == set(range(self.begin, self.next_id))

    @invariant()
    def priorities_and_maximum_match(self) -> None:
        ids = np.arange(self.begin, self.next_id, dtype=np.int64)
        assert self.rb.priorities(ids).tolist() == [self.prio[i] for i in ids.tolist()]
        assert self.rb.info()["max_priority"] == self.max_seen

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
