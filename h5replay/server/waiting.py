"""The waiting room: samples and commits the rate limiter holds back, until they may go or time out.

Pure: no sockets, no files. The writer's loop asks `admit` for each rate-limited request: it goes
ahead at once, is refused (it could never go ahead, or its caller gave no time to wait), or waits
here. After every change of the counters the loop takes `next_ready` requests, one at a time
(each one it runs changes the counters the next one is judged by), and `expire` ends those whose
caller's timeout has passed. Each lane (the inserts; the samples of one table) is first come, first
served: a waiting request is never overtaken by a later one of its lane, so a big sample cannot be
starved by a stream of small ones; a table's samples never wait behind another table's.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

__all__ = ["WaitingRoom", "Waiting", "Side", "Check", "Lane"]

Side = Literal["sample", "insert"]
#: (side, rows, table: the table a sample draws from, None for inserts and a buffer's only table)
#: -> (why it must wait or None, whether it would wait forever)
Check = Callable[[Side, int, "str | None"], tuple[str | None, bool]]
#: A queue of its own: (side, table).
Lane = tuple[Side, "str | None"]
_T = TypeVar("_T")


@dataclass
class Waiting(Generic[_T]):
    """A request waiting for the rate limiter."""

    side: Side
    rows: int
    deadline: float
    since: float
    payload: _T
    reason: str = ""
    table: str | None = None

    @property
    def lane(self) -> Lane:
        return self.side, self.table


@dataclass
class WaitingRoom(Generic[_T]):
    """Requests held back by the rate limit, per lane, in arrival order."""

    check: Check
    clock: Callable[[], float] = time.monotonic
    max_waiting: int = 10_000
    queues: dict[Lane, deque[Waiting[_T]]] = field(default_factory=dict)
    #: Seconds every request of a side has spent waiting (those still waiting up to now).
    waited: dict[Side, float] = field(default_factory=lambda: {"sample": 0.0, "insert": 0.0})

    def __len__(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def count(self, side: Side) -> int:
        """Requests of `side` waiting (every table's, for samples)."""
        return sum(len(q) for (s, _), q in self.queues.items() if s == side)

    def admit(self, side: Side, rows: int, timeout: float, payload: _T, table: str | None = None) -> tuple[str, str | None]:
        """Whether a request may go now: ("go", None), ("refused", why) or ("waiting", why).

        A request waits only behind nothing of its lane (first come, first served) and while
        its timeout lasts; one that could never go ahead is refused at once."""
        why, never = self.check(side, rows, table)
        if never:
            return "refused", why
        queue = self.queues.setdefault((side, table), deque())
        if why is None and not queue:
            return "go", None
        if why is None:
            why = f"{len(queue)} earlier {side} request(s) are waiting for the rate limit"
        if timeout <= 0:
            return "refused", why
        if len(self) >= self.max_waiting:
            return "refused", f"{why}; and {len(self)} requests already wait, the most this server holds"
        now = self.clock()
        queue.append(Waiting(side, rows, now + timeout, now, payload, why, table))
        return "waiting", why

    def next_ready(self) -> Waiting[_T] | None:
        """The first waiting request (of either side, oldest first) that may go now, taken out."""
        heads = [q[0] for q in self.queues.values() if q]
        for head in sorted(heads, key=lambda w: w.since):
            why, _ = self.check(head.side, head.rows, head.table)
            if why is None:
                self.queues[head.lane].popleft()
                self._account(head)
                return head
            head.reason = why
        return None

    def expire(self) -> list[Waiting[_T]]:
        """Take out every request whose deadline has passed (with the reason it still waited)."""
        now = self.clock()
        out: list[Waiting[_T]] = []
        for queue in self.queues.values():
            keep = deque(w for w in queue if w.deadline > now)
            for w in queue:
                if w.deadline <= now:
                    why, _ = self.check(w.side, w.rows, w.table)
                    w.reason = why or w.reason
                    self._account(w)
                    out.append(w)
            queue.clear()
            queue.extend(keep)
        return out

    def drop(self, keep: Callable[[_T], bool]) -> list[Waiting[_T]]:
        """Take out the waiting requests whose payload `keep` refuses (a client that went away)."""
        out: list[Waiting[_T]] = []
        for queue in self.queues.values():
            kept = deque(w for w in queue if keep(w.payload))
            out += [w for w in queue if not keep(w.payload)]
            queue.clear()
            queue.extend(kept)
        for w in out:
            self._account(w)
        return out

    def next_deadline(self) -> float | None:
        deadlines = [w.deadline for q in self.queues.values() for w in q]
        return min(deadlines) if deadlines else None

    def waited_now(self, side: Side) -> float:
        """Seconds waited on `side`, counting the requests still waiting up to now."""
        now = self.clock()
        return self.waited[side] + sum(now - w.since for (s, _), q in self.queues.items() if s == side for w in q)

    def _account(self, w: Waiting[Any]) -> None:
        self.waited[w.side] += max(0.0, self.clock() - w.since)
