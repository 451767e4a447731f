"""A learner's priority updates sent with `wait=False`: held, merged, in flight, their replies read.

Up to `max_in_flight` messages of updates travel at once; further updates are held and leave
merged into as few messages as fit (in call order: a later priority for a row still wins) as soon
as a reply makes room. Replies are read as they come; the first refusal is kept and raised by the
next call; a server that does not answer gives up those travelling and those held. No socket of
its own: the updates go through the learner's writer Connection.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection
from h5replay.client._core.reads import update_requests
from h5replay.errors import ClosedError, ServerUnavailableError

__all__ = ["PriorityUpdates"]


class PriorityUpdates:
    """The priority updates of one learner, over its writer connection `conn`.

    Args:
        conn: the learner's connection to the writer.
        max_in_flight: messages of updates that may travel at once.
        timeout: seconds to wait for a reply (it leaves after the publish carrying the update).
        ids_per_message: row ids one message carries (ids and priorities share it).
    """

    def __init__(self, conn: Connection, max_in_flight: int, timeout: float, ids_per_message: int) -> None:
        self._conn = conn
        self._max_in_flight = max_in_flight
        self.timeout = timeout
        self._ids_per_message = ids_per_message
        self.seen_seq = 0  # the newest publish this client's own writes (priority updates) made
        # Priority updates sent with wait=False whose replies were not read yet (request ids).
        self._in_flight: deque[int] = deque()
        # Priority updates made with wait=False, checked, that wait for room among those in
        # flight: (row ids, priorities, table) in call order, sent merged (a table's with its
        # own) into as few messages as fit.
        self._held: list[tuple[np.ndarray, np.ndarray, str | None]] = []
        self._held_ids = 0
        self._refusal: Exception | None = None  # the first refusal of one, raised by the next call
        self.lock = threading.RLock()
        #: Ids ignored by the priority updates sent with wait=False, as their replies came back.
        self.ignored = 0

    @property
    def pending(self) -> bool:
        """Whether updates are held here or travel (a read sees this client's own: flush first)."""
        return bool(self._in_flight or self._held)

    def send(self, ids: np.ndarray, values: np.ndarray, seen: int, table: str | None = None) -> None:
        """Send checked updates without waiting for their replies (LearnerClient.update_priorities
        with wait=False); `seen`: the end of the newest view, below which every id was in a reply.

        Raises:
            The first refusal of an earlier update; ServerUnavailableError, ClosedError (then the
            updates travelling and held are given up).
        """
        with self.lock:
            try:
                if ids.size and int(ids.max()) >= seen:  # may be refused (never committed): alone
                    self._send_held(block=True)
                    self._send_updates(ids, values, table)
                else:
                    self._held.append((ids, values, table))
                    self._held_ids += ids.shape[0]
                    self._send_held(block=self._held_ids >= self._ids_per_message // 2)  # a message's worth
            except (ServerUnavailableError, ClosedError):
                self._give_up()
                raise
            self._raise_refusal()

    def flush(self) -> None:
        """Send the priority updates made with wait=False that are still held here, and wait for
        the replies of all of them. The server's refusal of one (ConfigError, IndexError) is
        raised after the others were read; when the server does not answer
        (ServerUnavailableError) the rest are given up."""
        with self.lock:
            try:
                self._send_held(block=True)
                while self._in_flight:
                    self._settle(self._in_flight.popleft())
            except (ServerUnavailableError, ClosedError):
                self._give_up()
                raise
            self._raise_refusal()

    def requests(self, ids: np.ndarray, values: np.ndarray, table: str | None = None) -> list[Callable[[int], P.Request]]:
        """Checked updates of `table` as requests that fit a message each (ids and priorities
        share it; one empty request for no ids)."""
        return update_requests(ids, values, table, self._ids_per_message)

    def _send_held(self, block: bool) -> None:
        """Send the held updates, merged, once replies make room among those in flight; with
        `block`, wait for that room (else leave them held when there is none)."""
        while self._in_flight and self._conn.arrived(self._in_flight[0]):
            self._settle(self._in_flight.popleft())
        if not self._held or (not block and len(self._in_flight) >= self._max_in_flight):
            return
        held, self._held, self._held_ids = self._held, [], 0
        for table in dict.fromkeys(h[2] for h in held):  # each table's in call order (tables are apart)
            mine = [h for h in held if h[2] == table]
            ids = np.concatenate([h[0] for h in mine]) if len(mine) > 1 else mine[0][0]
            values = np.concatenate([h[1] for h in mine]) if len(mine) > 1 else mine[0][1]
            self._send_updates(ids, values, table)

    def _send_updates(self, ids: np.ndarray, values: np.ndarray, table: str | None = None) -> None:
        """Send checked updates in messages that fit, each once one of `max_in_flight` is free."""
        for request in self.requests(ids, values, table):
            while len(self._in_flight) >= self._max_in_flight:
                self._settle(self._in_flight.popleft())
            self._in_flight.append(self._conn.send(request))

    def _settle(self, request_id: int) -> None:
        """Read the reply of one update sent with wait=False. The server's refusal is kept, the
        first one only, for `_raise_refusal` (the updates after it still count); a server that
        does not answer raises here."""
        try:
            reply = self._conn.wait(request_id, self.timeout)
        except (ServerUnavailableError, ClosedError):
            raise
        except Exception as exc:  # the server refused this update: nothing of it was applied
            self._refusal = self._refusal or exc
            return
        self.seen_seq = max(self.seen_seq, int(reply.seq))  # type: ignore[attr-defined]
        self.ignored += int(reply.ignored)  # type: ignore[attr-defined]

    def _raise_refusal(self) -> None:
        error, self._refusal = self._refusal, None
        if error is not None:
            raise error

    def _give_up(self) -> None:
        """The server did not answer: forget the updates travelling and those held."""
        for rest in self._in_flight:
            self._conn.forget(rest)
        self._in_flight.clear()
        self._held, self._held_ids = [], 0
