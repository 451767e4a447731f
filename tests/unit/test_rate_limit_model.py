"""The rate limiter and the waiting room against a plain model of Reverb's SampleToInsertRatio.

Reverb's semantics (reverb/cc/rate_limiter.cc, reverb/rate_limiters.py), counted here in rows:
with `inserts` I, `samples` S and rows held H,
    can_insert(n) = H + n <= min_size  or  (I + n) * spi - S <= min_size * spi + error_buffer
    can_sample(n) = H >= min_size      and  I * spi - (S + n) >= min_size * spi - error_buffer
A request that cannot go waits, in arrival order per side, until it can or its timeout ends;
one that could never go (no sequence of other requests would ever let it: see `ReverbModel.never`)
is refused at once.

The system under test is the real thing: a ReplayBuffer with a RateLimit, and the WaitingRoom the
server's loop uses, on a fake clock. The model is this docstring, written out plainly.
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
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from h5replay.errors import RateLimitedError
from h5replay.sampling import RateLimit
from h5replay.server.waiting import WaitingRoom
from h5replay.storage import BoxSpace, ReplayBuffer


@dataclass
class Op:
    number: int
    side: str
    rows: int
    deadline: float
    since: float


class ReverbModel:
    """Plain counters and two FIFO queues."""

    def __init__(self, min_size: int, spi: float, error_buffer: float) -> None:
        self.min_size, self.spi, self.eb = min_size, spi, error_buffer
        self.inserts = self.samples = 0
        self.waiting: list[Op] = []

    def can(self, side: str, n: int) -> bool:
        if side == "insert":
            return (self.inserts + n <= self.min_size
                    or (self.inserts + n) * self.spi - self.samples <= self.min_size * self.spi + self.eb)
        return (self.inserts >= self.min_size
                and self.inserts * self.spi - (self.samples + n) >= self.min_size * self.spi - self.eb)

    def never(self, side: str, n: int) -> bool:
        """Whether no sequence of other requests could ever let it go: inserts only raise the
        balance and samples only lower it, each within [lo, hi] (a balance below lo, as at the
        start, only rises); an insert within the min-size zone is not limited at all."""
        balance = self.inserts * self.spi - self.samples
        lo, hi = self.min_size * self.spi - self.eb, self.min_size * self.spi + self.eb
        if side == "sample":
            return n > max(balance, hi) - lo
        return self.inserts + n > self.min_size and n * self.spi > hi - min(balance, lo)

    def run(self, op: Op) -> None:
        if op.side == "insert":
            self.inserts += op.rows
        else:
            self.samples += op.rows

    def drain(self) -> list[int]:
        done = []
        while True:
            heads = []
            for side in ("sample", "insert"):
                mine = [o for o in self.waiting if o.side == side]
                if mine:
                    heads.append(mine[0])
            ready = [o for o in sorted(heads, key=lambda o: o.since) if self.can(o.side, o.rows)]
            if not ready:
                return done
            self.waiting.remove(ready[0])
            self.run(ready[0])
            done.append(ready[0].number)


class RateLimitMachine(RuleBasedStateMachine):
    @initialize(min_size=st.integers(1, 30), spi=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
                slack=st.sampled_from([0.0, 1.0, 3.0, 10.0]))
    def setup(self, min_size: int, spi: float, slack: float) -> None:
        error_buffer = max(1.0, spi) + slack
        self.dir = tempfile.mkdtemp(prefix="h5r-limit-")
        self.rb = ReplayBuffer.create(BoxSpace(0, 2**40, (), np.int64), None, os.path.join(self.dir, "b.h5"),
                                      rate_limit=RateLimit(min_size, spi, error_buffer))
        self.now = 0.0
        self.room: WaitingRoom[int] = WaitingRoom(
            lambda side, rows, table: self.rb.rate_limit_blocker(rows, sampling=side == "sample", table=table),
            clock=lambda: self.now)
        self.model = ReverbModel(min_size, spi, error_buffer)
        self.number = 0
        self.done: list[int] = []
        self.model_done: list[int] = []
        self.failed: list[int] = []
        self.model_failed: list[int] = []

    def teardown(self) -> None:
        if hasattr(self, "rb"):
            self.rb.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def _execute(self, side: str, rows: int, number: int) -> None:
        before = self.rb.info()
        if side == "insert":
            self.rb.extend(np.arange(rows))
        else:
            self.rb.sample(rows)
        after = self.rb.info()
        spi, eb, m = self.model.spi, self.model.eb, self.model.min_size
        diff = after["inserted"] * spi - after["sampled"]
        if side == "insert" and after["inserted"] > m:
            assert diff <= m * spi + eb + 1e-9, f"insert {number} broke the ratio: {before} -> {after}"
        if side == "sample":
            assert diff >= m * spi - eb - 1e-9, f"sample {number} broke the ratio: {before} -> {after}"
        self.done.append(number)

    def _drain(self) -> None:
        while (w := self.room.next_ready()) is not None:
            self._execute(w.side, w.rows, w.payload)
        self.model_done += self.model.drain()

    @rule(side=st.sampled_from(["insert", "sample"]), rows=st.integers(1, 12),
          timeout=st.sampled_from([0.0, 0.5, 2.0, 10.0]))
    def request(self, side: str, rows: int, timeout: float) -> None:
        self.number += 1
        n = self.number
        status, why = self.room.admit(side, rows, timeout, n)  # type: ignore[arg-type]
        model_queue = [o for o in self.model.waiting if o.side == side]
        if self.model.never(side, rows):
            expected = "refused"
        elif not model_queue and self.model.can(side, rows):
            expected = "go"
        else:
            expected = "waiting" if timeout > 0 else "refused"
        assert status == expected, (status, why, side, rows, self.model.inserts, self.model.samples)
        if status == "go":
            self._execute(side, rows, n)
            self.model.run(Op(n, side, rows, 0, self.now))
            self.model_done.append(n)
            self._drain()
        elif status == "waiting":
            assert why
            self.model.waiting.append(Op(n, side, rows, self.now + timeout, self.now))
        else:
            assert why
            if not model_queue:  # a local call does not wait: the buffer refuses the same request
                with pytest.raises(RateLimitedError):
                    self._execute(side, rows, n)
            self.failed.append(n)
            self.model_failed.append(n)

    @rule(dt=st.sampled_from([0.1, 0.6, 3.0]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        for w in self.room.expire():
            assert w.reason, "a request that timed out says why it waited"
            self.failed.append(w.payload)
        gone = [o for o in self.model.waiting if o.deadline <= self.now]
        for o in gone:
            self.model.waiting.remove(o)
            self.model_failed.append(o.number)
        self._drain()

    @invariant()
    def agrees(self) -> None:
        info = self.rb.info()
        assert (info["inserted"], info["sampled"]) == (self.model.inserts, self.model.samples)
        assert self.done == self.model_done
        assert sorted(self.failed) == sorted(self.model_failed)
        assert len(self.room) == len(self.model.waiting)


RateLimitMachine.TestCase.settings = settings(stateful_step_count=40)
TestRateLimiter = RateLimitMachine.TestCase
