"""The blocking driver of the client core's plans (h5replay.client._core): each operation is done
on a `Connection` and waited for in this thread.

`run` drives a plan to its result; `stream` drives a plan that delivers values (`batches`) as an
iterator: leaving the loop (closing the iterator) throws `LoopLeft` into the plan, whose cleanup
(forgetting, or cancelling and keeping what was drawn) then runs here before the iterator closes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from h5replay.client._connection import Connection
from h5replay.client._core.ops import (
    READS,
    Deliver,
    FlushPriorities,
    Forget,
    LoopLeft,
    Now,
    Op,
    Plan,
    Send,
    Sleep,
    Wait,
)

__all__ = ["BlockingDriver"]

T = TypeVar("T")


class BlockingDriver:
    """Runs plans over the writer's connection and the readers' (the same object when the server
    answers reads itself); `flush` sends the priority updates held back (wait=False)."""

    def __init__(self, writer: Connection | None, reads: Connection | None, flush: Callable[[], None]) -> None:
        self.writer = writer
        self.reads = reads
        self._flush = flush

    @staticmethod
    def alone(plan: Plan[T]) -> T:
        """Run a plan that sends nothing (it may sleep and read the clock)."""
        return _ALONE.run(plan)

    def _do(self, op: Op) -> Any:
        if isinstance(op, Send):
            return self._conn(op.target).send(op.request, op.timeout)
        if isinstance(op, Wait):
            return self._conn(op.target).wait_reply(op.request_id, op.timeout)
        if isinstance(op, Forget):
            self._conn(op.target).forget(op.request_id)
        elif isinstance(op, Now):
            return time.monotonic()
        elif isinstance(op, Sleep):
            time.sleep(op.seconds)
        elif isinstance(op, FlushPriorities):
            self._flush()
        elif not isinstance(op, Deliver):
            raise TypeError(f"a plan yielded {op!r}, which is no operation")
        return None

    def _conn(self, target: str) -> Connection:
        conn = self.reads if target == READS else self.writer
        if conn is None:
            raise TypeError("this plan sends requests, and this driver has no connection")
        return conn

    def _step(self, plan: Plan[Any], value: Any, error: BaseException | None) -> Op:
        return plan.send(value) if error is None else plan.throw(error)

    def run(self, plan: Plan[T], error: BaseException | None = None) -> T:
        """The plan's result (its exception raised), every operation done here in turn; with
        `error`, the plan is resumed by throwing it in."""
        value: Any = None
        while True:
            try:
                op = self._step(plan, value, error)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value, error = None, None
            try:
                value = self._do(op)
            except BaseException as exc:  # the plan decides: forget, keep what was drawn, or raise
                error = exc

    def stream(self, plan: Plan[Any]) -> Iterator[Any]:
        """The values the plan delivers, in order; closing the iterator lets the plan clean up."""
        value: Any = None
        error: BaseException | None = None
        while True:
            try:
                op = self._step(plan, value, error)
            except StopIteration:
                return
            value, error = None, None
            if isinstance(op, Deliver):
                try:
                    yield op.value
                except GeneratorExit:
                    self._leave(plan)
                    raise
                continue
            try:
                value = self._do(op)
            except BaseException as exc:
                error = exc

    def _leave(self, plan: Plan[Any]) -> None:
        """The caller left the loop: the plan's cleanup runs to its end (LoopLeft swallowed)."""
        try:
            self.run(plan, LoopLeft())
        except LoopLeft:
            pass



_ALONE = BlockingDriver(None, None, lambda: None)
