"""Draws that change the server's state (a queue's removal, a rate limit's count), read so that no
row a draw handed out is given up on.

Such a draw cannot be made again: when a call sends several (a batch split over messages, or
`batches` in flight) and one fails, no more are sent, those still waiting for the rate limit are
cancelled (they are never drawn), and the others are read: what they drew goes to the learner's
kept rows (_kept.py). No socket of its own: the draws go through the learner's writer Connection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection
from h5replay.client._kept import Part
from h5replay.client._reads import sample_info
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ProtocolError, ServerUnavailableError

__all__ = ["ConsumingDraws"]


class ConsumingDraws:
    """The consuming draws of one learner over `conn` (the writer's: only it draws them);
    `observe` is told of every reply (the learner's view)."""

    def __init__(self, conn: Connection, config: ClientConfig, observe: Callable[[P.ReadReply], Any]) -> None:
        self._conn = conn
        self.config = config
        self._observe = observe

    def draw_all(self, factories: Sequence[Callable[[int], P.Request]]) -> tuple[list[Part], BaseException | None]:
        """(parts, first failure) of draws that change the server's state, `max_in_flight` at a
        time. No reply is given up on: after the first failure no more parts are sent, those
        still waiting for the rate limit are cancelled, and the others are read (they were
        drawn)."""
        conn = self._conn
        timeout = self.config.timeout + self.config.rate_limit_timeout
        parts: list[Part] = []
        pending: list[int] = []
        error: BaseException | None = None
        try:
            for factory in factories:
                if len(pending) >= self.config.max_in_flight:
                    drawn, error = self.collect(pending[:1], cancel=False, timeout=timeout)
                    del pending[:1]
                    parts += drawn
                    if error is not None:
                        break
                pending.append(conn.send(factory))
        except (ServerUnavailableError, ProtocolError) as exc:  # a part that could not leave
            error = exc
        drawn, late = self.collect(pending, cancel=error is not None, timeout=timeout)
        return parts + drawn, error or late

    def collect(self, request_ids: list[int], *, cancel: bool, timeout: float) -> tuple[list[Part], BaseException | None]:
        """(parts, first failure) of draws in flight, in order; with `cancel`, those still
        waiting for the rate limit are cancelled first (they are never drawn), and the others,
        served already, are waited for the client's timeout."""
        conn = self._conn
        cancelled: set[int] = set()
        if cancel and request_ids:
            try:
                reply = conn.request(lambda rid: P.Cancel(rid, np.array(request_ids, np.uint64)))
                cancelled = {int(i) for i in reply.request_ids}  # type: ignore[attr-defined]
                timeout = self.config.timeout
            except (ServerUnavailableError, ProtocolError):
                pass  # an older server cannot cancel: wait for them all
        parts: list[Part] = []
        error: BaseException | None = None
        for request_id in request_ids:
            if request_id in cancelled:
                conn.forget(request_id)
                continue
            try:
                reply = conn.wait(request_id, timeout)
            except ClosedError:
                raise
            except Exception as exc:  # the server's refusal, or no answer: nothing of it was drawn here
                error = error or exc
                continue
            self._observe(reply)  # type: ignore[arg-type]
            parts.append((reply.arrays, sample_info([reply])))  # type: ignore[attr-defined]
        return parts, error
