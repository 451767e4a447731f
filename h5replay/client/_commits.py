"""A commit on its way: the message that commits episodes, queued, in flight, then settled.

An ActorClient sends commits and pushes with `wait=False` and holds them here (`_Flight`) until
their replies come; the caller holds a `PendingCommit`. Episodes of segments committed with
`wait=False` may wait in the client's next message (`_Queue`) and leave together as one
push_episodes. No socket of its own: each flight goes through the client's Connection.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from typing import Protocol

from h5replay.client._connection import Connection
from h5replay.client._core.actor import Ready, Retried, Settled, receipts, settle_commit
from h5replay.client._drive import BlockingDriver
from h5replay.records import Receipt

__all__ = ["PendingCommit"]


class _CommitQueue(Protocol):
    """The client a queued flight waits in (an ActorClient): it sends its queued message."""

    def _pump(self) -> None: ...

    def _send_queue(self) -> None: ...


class _Flight:
    """One message that commits episodes (a commit, a push, a push of several): queued in the
    client (segments committed with wait=False, see `ActorClient._queue_commit`), then in flight
    (sent again with the same keys while no reply comes), then settled."""

    def __init__(self, conn: Connection | None, driver: BlockingDriver | None, retried: Retried | None,
                 settled: list[Settled | None] | None = None, failures: deque[_Flight] | None = None,
                 receipts: list[Receipt] | None = None, client: _CommitQueue | None = None) -> None:
        self.conn = conn
        self.driver = driver
        self.retried = retried
        self.settled = settled  # one callback (or None) per episode, told its receipt or the error
        self.failures = failures  # where a failure waits for `flush` (messages in flight only)
        self.receipts = receipts
        self.error: Exception | None = None
        self.observed = False  # the caller saw the outcome through `result()` (or `flush` reported it)
        self.lock = threading.Lock()
        #: The client whose next message this is, while it waits there (None once sent).
        self.queued_in = client

    def done(self) -> bool:
        client = self.queued_in
        if client is not None:
            client._pump()  # it leaves now if there is room
            if self.queued_in is not None:
                return False
        retried, conn = self.retried, self.conn
        return retried is None or conn is None or conn.closed or conn.arrived(retried.request_id)

    def settle(self) -> None:
        """Wait for the outcome and keep it (the error too: `PendingCommit.result` raises it)."""
        client = self.queued_in
        if client is not None:
            client._send_queue()  # before this flight's lock: the client's lock comes first
        with self.lock:
            retried, driver = self.retried, self.driver
            if retried is None or driver is None:
                return
            try:
                self.receipts = receipts(driver.run(settle_commit(retried)))
            except Exception as exc:
                self._failed(exc)
            self.retried = None  # the request (and the episodes' arrays it holds) can go
        self._tell()

    def _failed(self, exc: Exception) -> None:
        self.error = exc
        if self.failures is not None:
            self.failures.append(self)

    def fail_unsent(self, exc: Exception) -> None:
        """It could not be sent (no server connected in time): not in doubt."""
        with self.lock:
            self.queued_in = None
            self._failed(exc)
        self._tell()

    def _tell(self) -> None:
        callbacks, self.settled = self.settled, None
        for i, callback in enumerate(callbacks or ()):
            if callback is not None:
                callback(self.receipts[i] if self.receipts and i < len(self.receipts) else None, self.error)


@dataclasses.dataclass
class _Queue:
    """The next message of a client, while its episodes wait for room in flight."""

    flight: _Flight
    episodes: list[Ready] = dataclasses.field(default_factory=list)
    rows: int = 0


class PendingCommit:
    """A commit on its way, from `push_episode(..., wait=False)`, `push_episodes(..., wait=False)`
    or `commit(wait=False)`.

    The episode has left the client, or (a segment's, while `max_in_flight` messages are out)
    waits in the client's next message (see `ActorSegment.commit`). `result()` sends it if it
    still waits, then waits for the server's acknowledgement, sending the commit again with its
    idempotency key when no reply comes (as a waited commit does), and returns the receipt, or
    raises what the commit would have raised. Its time runs from the send: `commit_timeout` in
    all. Episodes sent in one message settle together.
    """

    def __init__(self, flight: _Flight, key: bytes, index: int = 0) -> None:
        #: The episode's idempotency key: a commit of the same rows with it is never stored twice.
        self.key = key
        self._flight = flight
        self._index = index

    @classmethod
    def done_with(cls, receipt: Receipt, key: bytes = b"") -> PendingCommit:
        """One already settled (an empty episode, or a commit over several servers, waited for)."""
        return cls(_Flight(None, None, None, receipts=[receipt]), key)

    def done(self) -> bool:
        """Whether the outcome is here: `result()` then returns (or raises) without waiting."""
        return self._flight.done()

    def result(self) -> Receipt:
        """The receipt, once the server has the episode in the file, flushed (waits for it).

        Raises:
            ServerUnavailableError: no reply to any attempt within `commit_timeout`: the commit is
                in doubt (commit the same rows with `key` to settle it).
            DiskFullError, RateLimitedError, ...: the server refused the commit.
        """
        flight = self._flight
        flight.settle()
        flight.observed = True
        if flight.error is not None:
            raise flight.error
        return flight.receipts[self._index] if flight.receipts else Receipt(-1, -1, 0)

    def __repr__(self) -> str:
        flight = self._flight
        state = "queued" if flight.queued_in is not None else "in flight" if flight.retried is not None \
            else "failed" if flight.error is not None else "done"
        return f"PendingCommit({state}, key={self.key.hex()})"
