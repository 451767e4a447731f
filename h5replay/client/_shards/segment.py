"""One episode written over shards: streamed to the current shard, a copy kept until its commit is
acknowledged, moved whole to the next live shard when that one is lost.

`SegmentRouting` holds the episode and its routing as plans (`ActorPlan`: each shard segment's
verb a `Call`), which the blocking `ShardedSegment` here and the asyncio `AsyncShardedSegment`
(h5replay.client.aio._shard_actor) run through their actor's router.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, NoReturn, overload

import numpy as np

from h5replay.client._commits import PendingCommit
from h5replay.client._shards._router import ActorPlan, Call
from h5replay.errors import ClosedError, CommitInDoubtError, SegmentStateError, ServerUnavailableError
from h5replay.priorities import Given, PriorityColumns, one_row_priorities
from h5replay.protocol import IDEMPOTENCY_KEY_BYTES
from h5replay.records import Receipt

__all__ = ["SegmentRouting", "ShardedSegment", "Rows"]


class Rows:
    """Every row of the episode so far (storage form), kept until its commit is acknowledged."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._priorities: PriorityColumns | None = None  # once a row is given one
        self.num_rows = 0
        self.final: dict[str, np.ndarray] | None = None  # the episode's final observation (storage form)

    def add(self, encoded: Mapping[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        if priorities or self._priorities is not None:
            if self._priorities is None:
                self._priorities = PriorityColumns()
            self._priorities.put(self.num_rows, n, priorities)
        if not self._arrays:
            self._arrays = {k: np.empty((max(n, 64), *v.shape[1:]), v.dtype) for k, v in encoded.items()}
        room = next(iter(self._arrays.values())).shape[0]
        if self.num_rows + n > room:  # double: amortised O(1) per row
            size = max(2 * room, self.num_rows + n)
            for key, old in self._arrays.items():
                new = np.empty((size, *old.shape[1:]), old.dtype)
                new[: self.num_rows] = old[: self.num_rows]
                self._arrays[key] = new
        for key, arr in encoded.items():
            self._arrays[key][self.num_rows : self.num_rows + n] = arr[:n]
        self.num_rows += n

    def view(self) -> dict[str, np.ndarray]:
        return {k: a[: self.num_rows] for k, a in self._arrays.items()}

    def priorities(self) -> Given | None:
        return None if self._priorities is None else self._priorities.rows(self.num_rows)


#: A shard's segment verbs that mean its shard was lost (or restarted): the episode moves.
_LOST = (ServerUnavailableError, SegmentStateError, ClosedError)


class SegmentRouting:
    """One episode written through an actor over shards: its rows, its key, and the plans that
    route it (`add`, `commit`, `abort`).

    Attributes:
        key: the episode's idempotency key, made once, the same on every retry.
        shard: the shard that acknowledged the commit (None before).
        in_doubt_on: the shard where a commit of this episode was sent and no reply came back
            (None: none): from then on the episode goes to no other shard.
    """

    def __init__(self, actor: Any) -> None:  # the ActorRouting that opens it (its module imports this one)
        self._actor = actor
        self._rows = Rows()
        self._inner: Any = None  # the segment on shard `_inner_shard` (an ActorSegment / AsyncActorSegment)
        self._inner_shard = -1
        self.key = os.urandom(IDEMPOTENCY_KEY_BYTES)
        self.shard: int | None = None
        self.in_doubt_on: int | None = None
        self.length = 0
        self.receipt: Receipt | None = None
        self._state = "open"

    def __len__(self) -> int:
        return self.length

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise SegmentStateError(f"cannot {what} a segment that was {self._state}")

    def _encoded_step(self, step: Any, priority: float | Mapping[str, float] | None) -> tuple[Any, Given | None]:
        self._require_open("append to")
        given = None if priority is None else self._actor.codec.check_priorities(one_row_priorities(priority), 1)
        return self._actor.codec.encode_one(step), given

    def _encoded_batch(self, batch: Any, priorities: Any) -> tuple[dict[str, np.ndarray], int, Given | None]:
        self._require_open("extend")
        encoded, n = self._actor.codec.encode_batch(batch)
        return encoded, n, self._actor.codec.check_priorities(priorities, n)

    def add_plan(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> ActorPlan[None]:
        """Add rows already checked and in storage form: kept here, streamed to the current shard."""
        self._require_open("extend")
        if n == 0:
            return
        self._rows.add(encoded, n, priorities)
        self.length += n
        try:
            yield from self._attempt(lambda inner: inner.extend_encoded(encoded, n, priorities), rows=True)
        except BaseException:
            self._give_up()
            raise

    def _open(self) -> ActorPlan[Any]:
        """The segment on the current shard, opened (with every row so far) when there is none.

        Raises:
            ServerUnavailableError: no shard answers.
        """
        while self._inner is None:
            if self.in_doubt_on is not None:  # its commit may have landed there: only there
                index, pinned = self.in_doubt_on, self._actor.client_of(self.in_doubt_on)
                if pinned is None:
                    self._park()
                client = pinned
            else:
                index, client = yield from self._actor.writer_plan()
            inner = self._actor.new_segment(client, self.key)
            inner.set_final_encoded(self._rows.final)
            self._inner, self._inner_shard = inner, index
            self._actor.use(index, +1)
            if self._rows.num_rows:
                rows, n, given = self._rows.view(), self._rows.num_rows, self._rows.priorities()
                try:
                    yield Call(functools.partial(inner.extend_encoded, rows, n, given))
                except _LOST as exc:
                    yield from self._lost(exc)
        return self._inner

    def _attempt(self, action: Callable[[Any], Any], *, rows: bool) -> ActorPlan[Any]:
        """`action` on the segment of the current shard; when the shard is lost, the whole episode
        moves to the next live one (a new segment there already holds every row, `rows=True`)."""
        while True:
            fresh = self._inner is None
            inner = yield from self._open()
            if fresh and rows:
                return None
            try:
                return (yield Call(functools.partial(action, inner)))
            except _LOST as exc:
                yield from self._lost(exc)

    def _lost(self, exc: BaseException) -> ActorPlan[None]:
        """The segment on shard `_inner_shard` is gone (its server did not answer, or restarted)."""
        inner, index = self._inner, self._inner_shard
        self._inner = None
        self._actor.use(index, -1)
        if isinstance(exc, ClosedError):
            if self._actor.closed:
                raise exc  # the user closed the actor
            return  # the actor closed that connection (its shard was lost or restarted): open it again
        if isinstance(exc, ServerUnavailableError) and inner is not None and inner.in_doubt:
            if self.in_doubt_on is None:
                # The commit may have landed: ask the same shard once more (a new hello). The
                # episode opened there again commits with the same key, and a shard that applied
                # it answers with its receipt. A shard that does not answer the hello is marked
                # down, and the actor keeps the episode (_open parks it).
                self.in_doubt_on = index
                yield from self._actor.reconnect_plan(index)
                return
            self._actor.lose(index, exc)
            self._park()
        if isinstance(exc, SegmentStateError):
            if not (yield from self._actor.restarted_plan(index)):
                raise exc  # a refusal of this segment, not a lost server
            yield from self._actor.reconnect_plan(index)  # the same shard, a new process: open it there again
        else:
            self._actor.lose(index, exc)

    def set_final(self, final: Any) -> None:
        """The observation after the episode's last step, as `ActorSegment.set_final` takes it:
        sent with the commit, to whichever shard takes the episode."""
        self._require_open("set the final observation of")
        self._rows.final = self._actor.codec.encode_final(final)
        if self._inner is not None:
            self._inner.set_final_encoded(self._rows.final)

    def commit_plan(self, final: Any = None) -> ActorPlan[Receipt]:
        """Send what is buffered, wait for every append, then commit on the current shard; on
        another shard when it stops answering. Returns after a shard has the episode in its file.

        Raises:
            ServerUnavailableError: no shard answers (the episode is lost).
            CommitInDoubtError: the shard this episode's commit was sent to lost the reply and did
                not answer again: the actor keeps the episode and settles it there later.
        """
        self._require_open("commit")
        if final is not None:
            self.set_final(final)
        if self.length == 0:
            self._state = "committed"
            receipt = self.receipt = Receipt(-1, -1, 0)
            return receipt
        try:
            # A shard segment's own commit retries with the episode's key; a server only knows its
            # own keys, so an episode whose commit reply was lost is retried only on that shard
            # (_lost) and kept by the actor, to be settled there, when that shard does not answer.
            receipt = yield from self._attempt(lambda inner: inner.commit(), rows=False)
        except BaseException:
            self._give_up()
            raise
        self._state, self.receipt, self.shard = "committed", receipt, self._inner_shard
        self._actor.use(self._inner_shard, -1)
        return receipt  # type: ignore[no-any-return]

    def _park(self) -> NoReturn:
        """The shard that lost this episode's commit reply does not answer: the actor keeps the
        episode, to settle it there later; the caller learns it from CommitInDoubtError."""
        index = self.in_doubt_on
        if index is None:
            raise SegmentStateError("internal: parking an episode that is not in doubt")
        self._state = "kept in doubt"
        self._actor.park(self.key, index, self._rows)
        raise CommitInDoubtError(
            f"shard {index} ({self._actor.endpoints[index]}) stopped answering after the commit of this episode "
            f"({self.length} rows) was sent to it, so it may hold it. The actor keeps the episode and commits it "
            "there with its idempotency key when the shard answers again (ActorClient.in_doubt, "
            "ActorClient.settle()): do not push it again, it would be held twice",
            self.key, index, self.length,
        )

    def _give_up(self) -> None:
        if self._state == "open":
            self._state = "failed"
        if self._inner is not None:
            self._inner = None
            self._actor.use(self._inner_shard, -1)

    def abort_plan(self) -> ActorPlan[None]:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._rows = Rows()
        if self._inner is not None:
            inner, self._inner = self._inner, None
            self._actor.use(self._inner_shard, -1)
            yield Call(inner.abort)


class ShardedSegment(SegmentRouting):
    """One episode written through `ActorClient(endpoints=[...])`: `append`, `extend`, then
    `commit` or `abort`. Rows stream to the current shard as with a single server, and a copy
    stays here until the commit is acknowledged: when the shard stops answering, the episode is
    opened again on the next live shard and every row so far goes there again."""

    def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority for every prioritized table, or by table name);
        checked now, sent soon."""
        encoded, given = self._encoded_step(step, priority)
        self._actor.run(self.add_plan(encoded, 1, given))

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        self._actor.run(self.add_plan(*self._encoded_batch(batch, priorities)))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`)."""
        self._actor.run(self.add_plan(encoded, n, priorities))

    @overload
    def commit(self, *, wait: Literal[True] = True, final: Any = None) -> Receipt: ...
    @overload
    def commit(self, *, wait: Literal[False], final: Any = None) -> PendingCommit: ...

    def commit(self, *, wait: bool = True, final: Any = None) -> Receipt | PendingCommit:
        """See `SegmentRouting.commit_plan`. Over several servers a commit is always waited for:
        with `wait=False` (as for one server) a done `PendingCommit` is returned."""
        receipt = self._actor.run(self.commit_plan(final))
        return receipt if wait else PendingCommit.done_with(receipt)

    def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        self._actor.run(self.abort_plan())

    def __enter__(self) -> ShardedSegment:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self._state != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            try:
                self.abort()
            except ClosedError:
                pass
