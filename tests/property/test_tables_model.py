"""Several tables over one ring of rows, against a plain Python model (a hypothesis state machine).

The model keeps the ring (rows [begin, end), the capacity pushing the oldest out) and, per table,
how often each row was sampled, its rows sampled in all, and (prioritized) each row's priority.
Each world mixes tables the way users do: a prioritized replay beside a FIFO queue, a uniform
table that removes a row after two samples, a rate-limited table. What must hold:

* a row a queue table removed is still drawn by the other tables; it leaves the ring before the
  capacity pushes it out only when every table has removed it (only when every table removes);
* each table's draws follow its own sampler (the queue hands out the oldest rows it has not
  removed, in order; the prioritized table's probabilities are exactly p ** e over the sum);
* each table's rate limit holds alone (its samples wait on its own count; inserts wait while
  any table's balance is too far ahead) and its counters are exact;
* all of it is the same after a close and reopen.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from h5replay.errors import ConfigError, NotEnoughDataError, RateLimitedError
from h5replay.sampling import Fifo, Lifo, Prioritized, RateLimit, Table, Uniform
from h5replay.storage import BoxSpace, ReplayBuffer

SPACE = BoxSpace(0, 2**40, (), np.int64)  # every row holds its own id

WORLDS: dict[str, dict[str, Table]] = {
    "replay and queue": {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1)},
    "replay, queue and twice": {"replay": Table(Prioritized(0.5)), "queue": Table(Fifo(), max_times_sampled=1),
                                "twice": Table(Uniform(), max_times_sampled=2)},
    "two queues": {"oldest": Table(Fifo(), max_times_sampled=1), "newest": Table(Lifo(), max_times_sampled=1)},
    "limited replay and queue": {"replay": Table(Uniform(), rate_limit=RateLimit(2, 1.0, 6.0)),
                                 "queue": Table(Fifo(), max_times_sampled=1)},
    "two rate limits": {"slow": Table(Uniform(), rate_limit=RateLimit(1, 1.0, 4.0)),
                        "fast": Table(Prioritized(1.0), rate_limit=RateLimit(1, 2.0, 8.0))},
}


@dataclass
class ModelTable:
    config: Table
    times: dict[int, int]
    sampled: int = 0

    def alive(self, i: int) -> bool:
        m = self.config.max_times_sampled
        return not m or self.times.get(i, 0) < m


class TablesMachine(RuleBasedStateMachine):
    @initialize(world=st.sampled_from(sorted(WORLDS)), capacity=st.sampled_from([6, 10, None]))
    def setup(self, world: str, capacity: int | None) -> None:
        self.dir = tempfile.mkdtemp(prefix="h5r-tables-")
        self.path = os.path.join(self.dir, "b.h5")
        self.configs = WORLDS[world]
        self.capacity = capacity
        self.rb = ReplayBuffer.create(SPACE, capacity, self.path, tables=self.configs)
        self.tables = {name: ModelTable(config, {}) for name, config in self.configs.items()}
        self.prio: dict[int, float] = {}
        self.begin = self.end = self.inserted = 0
        self.rng = np.random.default_rng(0)

    def teardown(self) -> None:
        if hasattr(self, "rb"):
            self.rb.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ the model's arithmetic

    def _held(self) -> range:
        return range(self.begin, self.end)

    def _sampleable(self, t: ModelTable) -> list[int]:
        return [i for i in self._held() if t.alive(i)]

    def _insert_waits(self, n: int) -> bool:
        for t in self.tables.values():
            limit = t.config.rate_limit
            if limit.samples_per_insert is None or len(self._sampleable(t)) + n <= limit.min_size_to_sample:
                continue
            top = limit.min_size_to_sample * limit.samples_per_insert + (limit.error_buffer or 0)
            if (self.inserted + n) * limit.samples_per_insert - t.sampled > top:
                return True
        return False

    def _sample_waits(self, t: ModelTable, k: int) -> bool:
        limit = t.config.rate_limit
        if not limit.active:
            return False
        if len(self._sampleable(t)) < limit.min_size_to_sample:
            return True
        if limit.samples_per_insert is None:
            return False
        bottom = limit.min_size_to_sample * limit.samples_per_insert - (limit.error_buffer or 0)
        return self.inserted * limit.samples_per_insert - (t.sampled + k) < bottom

    def _release(self) -> None:
        """The ring lets go of rows every table removed (only when every table removes)."""
        if all(t.config.max_times_sampled for t in self.tables.values()):
            while self.begin < self.end and not any(t.alive(self.begin) for t in self.tables.values()):
                self.begin += 1

    # ------------------------------------------------------------------ rules

    @rule(n=st.integers(1, 4), priorities=st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4), whole=st.booleans())
    def extend(self, n: int, priorities: list[float], whole: bool) -> None:
        prioritized = [name for name, c in self.configs.items() if c.prioritized]
        given = np.array(priorities[:n]) if prioritized and whole else None
        if prioritized and not whole:
            given = {prioritized[0]: np.array(priorities[:n])}
        if self._insert_waits(n):
            with pytest.raises(RateLimitedError):
                self.rb.extend(np.arange(self.end, self.end + n), priorities=given)
            return
        self.rb.extend(np.arange(self.end, self.end + n), priorities=given)
        self.rb.end_episode()
        for k in range(n):
            self.prio[self.end + k] = float(priorities[k]) if given is not None else 1.0
        self.end += n
        self.inserted += n
        if self.capacity is not None:
            self.begin = max(self.begin, self.end - self.capacity)

    @rule(data=st.data(), k=st.integers(1, 3))
    def sample(self, data: st.DataObject, k: int) -> None:
        name = data.draw(st.sampled_from(sorted(self.tables)))
        t = self.tables[name]
        sampler = t.config.sampler
        alive = self._sampleable(t)
        without = isinstance(sampler, (Fifo, Lifo)) or bool(t.config.max_times_sampled)
        if self._sample_waits(t, k) or (without and t.config.rate_limit.active and k > len(alive)):
            with pytest.raises(RateLimitedError):
                self.rb.sample(k, self.rng, table=name)
            return
        if not alive or (without and k > len(alive)):
            with pytest.raises(NotEnoughDataError):
                self.rb.sample(k, self.rng, table=name)
            return
        batch, info = self.rb.sample(k, self.rng, with_info=True, table=name)
        ids = info.row_ids.astype(np.int64).tolist()
        assert batch.tolist() == ids  # every row holds its id
        assert set(ids) <= set(alive), f"{name} drew {ids}, not among the rows it may still sample {alive}"
        if isinstance(sampler, Fifo):
            assert ids == alive[:k]
        elif isinstance(sampler, Lifo):
            assert ids == alive[::-1][:k]
        elif isinstance(sampler, Prioritized):
            weights = {i: self.prio[i] ** sampler.exponent for i in alive}
            total = sum(weights.values())
            np.testing.assert_allclose(info.probabilities, [weights[i] / total for i in ids], rtol=1e-9)
        elif not without:
            np.testing.assert_allclose(info.probabilities, 1.0 / len(alive))
        if without:
            assert len(set(ids)) == len(ids)
        if t.config.max_times_sampled:
            for i in ids:
                t.times[i] = t.times.get(i, 0) + 1
        t.sampled += k
        self._release()

    @precondition(lambda self: any(c.prioritized for c in self.configs.values()))
    @rule(data=st.data(), value=st.floats(0.1, 10.0))
    def update(self, data: st.DataObject, value: float) -> None:
        name = next(n for n, c in self.configs.items() if c.prioritized)
        if self.end == 0:
            return
        i = data.draw(st.integers(0, self.end - 1))
        ignored = self.rb.update_priorities([i], [value], table=name)
        assert ignored == (0 if i >= self.begin else 1)
        if i >= self.begin:
            self.prio[i] = value

    @rule()
    def reopen(self) -> None:
        self.rb.close()
        self.rb = ReplayBuffer.load_from(self.path, read_only=False)
        assert self.rb.tables == self.configs

    @rule()
    def unnamed_or_unknown_table_is_refused(self) -> None:
        with pytest.raises(ConfigError, match="name one with table="):
            self.rb.sample(1, self.rng)
        with pytest.raises(ConfigError, match="no table 'nope'"):
            self.rb.sample(1, self.rng, table="nope")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def ring_and_counters_match(self) -> None:
        assert len(self.rb) == self.end - self.begin
        assert self.rb.view.begin == self.begin
        info = self.rb.info()
        for name, t in self.tables.items():
            assert info[f"table.{name}.sampled"] == t.sampled
            assert info[f"table.{name}.sampleable"] == len(self._sampleable(t))
            assert info[f"table.{name}.inserted"] == self.inserted


TablesMachine.TestCase.settings = settings(stateful_step_count=40, max_examples=100, deadline=None)
TestTables = TablesMachine.TestCase
