"""Commits of the asyncio actor on their way: `AsyncPendingCommit` (what a caller holds) and
the outcome the episodes of one message share (their receipts' future, and whether a caller saw
it, so that `flush` reports a failure once)."""

from __future__ import annotations

import asyncio
from typing import Any

from h5replay.errors import ClosedError
from h5replay.records import Receipt

__all__ = ["AsyncPendingCommit"]


def _copy_outcome(done: asyncio.Future[list[Receipt]], into: asyncio.Future[list[Receipt]]) -> None:
    if into.done():
        return
    if done.cancelled():
        into.cancel()
    elif done.exception() is not None:
        into.set_exception(done.exception())  # type: ignore[arg-type]
    else:
        into.set_result(done.result())


def _one_outcome(done: asyncio.Future[list[Receipt]], index: int) -> tuple[Receipt | None, Exception | None]:
    """(receipt, None) of episode `index` of a settled message, or (None, its error)."""
    if done.cancelled():
        return None, ClosedError("the commit's settling was cancelled (the client was closed)")
    error = done.exception()
    if error is not None:
        return None, error if isinstance(error, Exception) else RuntimeError(str(error))
    found = done.result()
    return (found[index] if index < len(found) else Receipt(-1, -1, 0)), None


class _Outcome:
    """How one message that commits episodes ends, shared by the pendings of its episodes: the
    future of their receipts, and whether a caller saw it (so `flush` reports a failure once)."""

    __slots__ = ("future", "observed")

    def __init__(self, future: asyncio.Future[list[Receipt]]) -> None:
        self.future = future
        self.observed = False


class AsyncPendingCommit:
    """A commit on its way, from `push_episode(..., wait=False)`, `push_episodes(..., wait=False)`
    or `commit(wait=False)`: the episode has left; a task of the client's loop waits for the
    server's acknowledgement (sending the commit again with its idempotency key while no reply
    comes). `await pending.result()` (or `await pending`) is the receipt, or raises what the
    commit would have raised. Episodes sent in one message settle together.
    """

    def __init__(self, outcome: _Outcome, key: bytes, index: int = 0) -> None:
        #: The episode's idempotency key: a commit of the same rows with it is never stored twice.
        self.key = key
        self._outcome = outcome
        self._settling = outcome.future
        self._index = index

    @classmethod
    def done_with(cls, receipt: Receipt, key: bytes = b"") -> AsyncPendingCommit:
        """One already settled (an empty episode)."""
        future: asyncio.Future[list[Receipt]] = asyncio.get_running_loop().create_future()
        future.set_result([receipt])
        return cls(_Outcome(future), key)

    def done(self) -> bool:
        """Whether the outcome is here: `result()` then returns (or raises) at once."""
        return self._settling.done()

    async def result(self) -> Receipt:
        """The receipt, once the server has the episode in the file, flushed.

        Raises:
            ServerUnavailableError: no reply to any attempt within `commit_timeout`: the commit is
                in doubt (commit the same rows with `key` to settle it).
            DiskFullError, RateLimitedError, ...: the server refused the commit.
        """
        self._outcome.observed = True  # the caller saw it: `flush` does not report it again
        # A cancelled caller does not cancel the settling: the commit's outcome is still learned.
        found = await asyncio.shield(self._settling)
        return found[self._index] if self._index < len(found) else Receipt(-1, -1, 0)

    def __await__(self) -> Any:
        return self.result().__await__()

    def __repr__(self) -> str:
        state = "in flight" if not self._settling.done() else "failed" if self._settling.exception() else "done"
        return f"AsyncPendingCommit({state}, key={self.key.hex()})"
