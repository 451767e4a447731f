"""ShardedActor: one home shard at a time, the episode in flight moved whole when a shard is lost.

See the package's docstring (h5replay.client._shards) for the behaviour.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, NamedTuple, ParamSpec, TypeVar

import numpy as np

from h5replay.client._shards._router import _Router, _Shard, home_shard, log
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ConfigError, SegmentStateError, ServerUnavailableError
from h5replay.protocol import IDEMPOTENCY_KEY_BYTES
from h5replay.records import Receipt
from h5replay.sampling import check_priorities

if TYPE_CHECKING:
    from h5replay.client.actor import ActorClient, ActorSegment

__all__ = ["InDoubt", "ShardedActor", "ShardedSegment"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[ShardedActor, _P], _R]) -> Callable[Concatenate[ShardedActor, _P], _R]:
    """Run the method under the actor's lock: segments of one actor may be used from several threads."""
    def locked(self: ShardedActor, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    functools.update_wrapper(locked, method)
    return locked


class InDoubt(NamedTuple):
    """An episode whose commit (or push) reply was lost with a shard that then did not answer
    again, and that another shard acknowledged: it may be held on both.

    Attributes:
        key: the episode's idempotency key (made once, sent again with every retry).
        lost_on: the shards where a commit of it was sent and no reply came.
        shard: the shard that acknowledged it in the end.
        receipt: that shard's receipt.
    """

    key: bytes
    lost_on: tuple[int, ...]
    shard: int
    receipt: Receipt


class _Rows:
    """Every row of the episode so far (storage form), kept until its commit is acknowledged."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self._priorities: np.ndarray | None = None  # per row, NaN where none was given; once one is
        self.num_rows = 0

    def add(self, encoded: Mapping[str, np.ndarray], n: int, priorities: np.ndarray | None = None) -> None:
        given = priorities is not None and len(priorities) > 0
        if given or self._priorities is not None:
            if self._priorities is None or self._priorities.shape[0] < self.num_rows + n:  # doubling, as below
                grown = np.full(max(64, 2 * self.num_rows, self.num_rows + n), np.nan)
                if self._priorities is not None:
                    grown[: self.num_rows] = self._priorities[: self.num_rows]
                self._priorities = grown
            self._priorities[self.num_rows : self.num_rows + n] = priorities if given else np.nan
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

    def priorities(self) -> np.ndarray | None:
        return None if self._priorities is None else self._priorities[: self.num_rows]


def _commit(segment: ActorSegment) -> Receipt:
    """Commit (or push) `segment` on its shard, with the episode's idempotency key (the segment
    was opened with ShardedSegment.key, the same on every retry, on this shard or another).

    A server only remembers its own keys: a retry on *another* shard cannot be told apart from a
    first commit there. So an in-doubt episode is retried with its key on the shard that lost the
    reply first (the segment's own retries, then ShardedSegment._lost), and moves on only when
    that shard does not answer.
    """
    return segment.commit()


class ShardedActor(_Router):
    """The routing of `ActorClient(endpoints=[...])`: one shard at a time, failing over.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored; `name` picks the home shard).
        secret_key, server_key: CURVE certificate files, the same for every shard.

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    role = "actor"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key)
        self.home = home_shard(config.name, len(self.shards))
        self.current = self.home
        #: Episodes whose commit reply was lost with a shard (the newest 1000).
        self.in_doubt: deque[InDoubt] = deque(maxlen=1000)
        self.num_failovers = 0
        self._using: Counter[int] = Counter()  # open segments per shard
        self._codec: ActorClient | None = None  # encodes steps (the space is every shard's)
        try:
            # A hello to every shard, so that a space mismatch shows now and not at a failover;
            # then only the shard written to keeps a connection (a server's client slots are few).
            self._connect_initial()
            self._codec = next(s.client for s in self.shards if s.client is not None)
            live = [s for s in self.shards if s.client is not None]
            self.current = next(s.index for s in self._ring(self.home) if s.client is not None)
            for shard in live:
                if shard.index != self.current:
                    shard.client.close()
                    shard.client = None
        except BaseException:
            self.close()
            raise

    def _make(self, endpoint: str) -> ActorClient:
        from h5replay.client.actor import ActorClient

        return ActorClient(**self._client_kwargs(endpoint))

    def _ring(self, start: int) -> list[_Shard]:
        return [self.shards[(start + k) % len(self.shards)] for k in range(len(self.shards))]

    def _wants_probe(self, shard: _Shard) -> bool:
        return shard.index == self.home and self.current != self.home

    def _adopted(self, shard: _Shard) -> None:
        """The home shard answers again: write there from the next episode on (segments still
        open on the other shard finish there; its connection closes once none is left)."""
        if shard.index == self.home and self.current != self.home:
            self.current = self.home

    @_locked
    def use(self, index: int, count: int) -> None:
        """A segment of this actor opened (+1) or finished (-1) on shard `index`."""
        self._using[index] += count

    def _close_idle(self) -> None:
        """Close the connections of shards this actor no longer writes to (a server's client slots
        are few)."""
        for shard in self.shards:
            if shard.index != self.current and shard.client is not None and self._using[shard.index] <= 0:
                client, shard.client = shard.client, None
                client.close()

    @property
    def codec(self) -> ActorClient:
        if self._codec is None:
            raise ClosedError("this actor never connected")
        return self._codec

    @_locked
    def writer(self) -> tuple[int, ActorClient]:
        """(shard, client) to write the next rows to: the current shard, or the next live one.

        Raises:
            ServerUnavailableError: no shard answers.
        """
        self._check()
        self._poll_probes()
        self._close_idle()
        shard = self.shards[self.current]
        if shard.client is not None:
            return shard.index, shard.client
        now = time.monotonic()
        errors = []
        for candidate in self._ring(self.current):
            if candidate.client is not None:  # still connected (segments of this actor are open there)
                self.current = candidate.index
                self.num_failovers += 1
                return candidate.index, candidate.client
            if candidate.retry_at > now or candidate.probe is not None:
                continue
            try:
                client = self._make(candidate.endpoint)
            except ServerUnavailableError as exc:
                self._mark_down(candidate, exc)
                errors.append(f"{candidate.endpoint}: {exc}")
                continue
            try:
                self._admit(candidate, client)
            except ConfigError as exc:
                client.close()
                self._mark_down(candidate, exc)
                errors.append(f"{candidate.endpoint}: {exc}")
                continue
            if candidate.index != self.current:
                self.num_failovers += 1
                log.warning("actor %s writes to shard %d (%s) from now on", self.config.name, candidate.index,
                            candidate.endpoint)
            self.current = candidate.index
            return candidate.index, client
        raise ServerUnavailableError(
            f"no shard of {len(self.shards)} answers (each is tried again every {self.config.shard_retry_interval} s)"
            + (f": {'; '.join(errors)}" if errors else "")
        )

    @_locked
    def lose(self, index: int, exc: BaseException) -> None:
        """Shard `index` stopped answering while this actor wrote to it."""
        shard = self.shards[index]
        if shard.client is not None:
            self._mark_down(shard, exc)

    @_locked
    def restarted(self, index: int) -> bool:
        """Whether shard `index` is another server process than the one this actor said hello to
        (a restart quicker than the timeout: the new process knows none of the old one's segments)."""
        shard = self.shards[index]
        if shard.client is None:
            return True
        try:
            stats = shard.client.info()
        except ServerUnavailableError as exc:
            self._mark_down(shard, exc)
            return True
        return bool(stats.get("instance_id") != shard.client.instance_id)

    @_locked
    def reconnect(self, index: int) -> None:
        """Say hello again to shard `index` (after a restart); marks it down if it does not answer."""
        shard = self.shards[index]
        if shard.client is not None:
            client, shard.client = shard.client, None
            client.close()
        try:
            client = self._make(shard.endpoint)
        except ServerUnavailableError as exc:
            self._mark_down(shard, exc)
            return
        try:
            self._admit(shard, client)
        except ConfigError as exc:
            client.close()
            self._mark_down(shard, exc)

    def segment(self) -> ShardedSegment:
        self._check()
        return ShardedSegment(self)

    def push_episode(self, batch: Any, priorities: Any = None) -> Receipt:
        encoded, n = self.codec.encode_batch(batch)
        given = None if priorities is None else check_priorities(priorities, n)
        if n == 0:
            return Receipt(-1, -1, 0)
        seg = ShardedSegment(self)
        seg.extend_encoded(encoded, n, given)
        return seg.commit()

    def info(self) -> dict[str, Any]:
        """The current shard's figures, with "shard": its index."""
        index, client = self.writer()
        try:
            return {**client.info(), "shard": index}
        except ServerUnavailableError as exc:
            self.lose(index, exc)
            raise


class ShardedSegment:
    """One episode written through a ShardedActor: `append`, `extend`, then `commit` or `abort`.

    Rows stream to the current shard as with a single server, and a copy stays here until the
    commit is acknowledged: when the shard stops answering, the episode is opened again on the
    next live shard and every row so far goes there again.

    Attributes:
        key: the episode's idempotency key, made once, the same on every retry.
        shard: the shard that acknowledged the commit (None before).
        in_doubt_on: shards where a commit of this episode was sent and no reply came back.
    """

    def __init__(self, actor: ShardedActor) -> None:
        self._actor = actor
        self._rows = _Rows()
        self._inner: ActorSegment | None = None
        self._inner_shard = -1
        self.key = os.urandom(IDEMPOTENCY_KEY_BYTES)
        self.shard: int | None = None
        self.in_doubt_on: list[int] = []
        self.length = 0
        self.receipt: Receipt | None = None
        self._state = "open"

    def __len__(self) -> int:
        return self.length

    def _require_open(self, what: str) -> None:
        if self._state != "open":
            raise SegmentStateError(f"cannot {what} a segment that was {self._state}")

    def append(self, step: Any, priority: float | None = None) -> None:
        """Add one step (with its priority, for a prioritized server); checked now, sent soon."""
        self._require_open("append to")
        given = None if priority is None else check_priorities([priority], 1)
        self._add(self._actor.codec.encode_one(step), 1, given)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        self._require_open("extend")
        encoded, n = self._actor.codec.encode_batch(batch)
        self._add(encoded, n, None if priorities is None else check_priorities(priorities, n))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: np.ndarray | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`)."""
        self._require_open("extend")
        self._add(encoded, n, priorities)

    def _add(self, encoded: dict[str, np.ndarray], n: int, priorities: np.ndarray | None = None) -> None:
        if n == 0:
            return
        self._rows.add(encoded, n, priorities)
        self.length += n
        try:
            self._attempt(lambda inner: inner.extend_encoded(encoded, n, priorities), rows=True)
        except BaseException:
            self._give_up()
            raise

    def _open(self) -> ActorSegment:
        """The segment on the current shard, opened (with every row so far) when there is none.

        Raises:
            ServerUnavailableError: no shard answers.
        """
        from h5replay.client.actor import ActorSegment

        while self._inner is None:
            index, client = self._actor.writer()
            inner = ActorSegment(client, key=self.key)
            self._inner, self._inner_shard = inner, index
            self._actor.use(index, +1)
            if self._rows.num_rows:
                try:
                    inner.extend_encoded(self._rows.view(), self._rows.num_rows, self._rows.priorities())
                except (ServerUnavailableError, SegmentStateError, ClosedError) as exc:
                    self._lost(exc)
        return self._inner

    def _attempt(self, action: Callable[[ActorSegment], Any], *, rows: bool) -> Any:
        """`action` on the segment of the current shard; when the shard is lost, the whole episode
        moves to the next live one (a new segment there already holds every row, `rows=True`)."""
        while True:
            fresh = self._inner is None
            inner = self._open()
            if fresh and rows:
                return None
            try:
                return action(inner)
            except (ServerUnavailableError, SegmentStateError, ClosedError) as exc:
                self._lost(exc)

    def _lost(self, exc: BaseException) -> None:
        """The segment on shard `_inner_shard` is gone (its server did not answer, or restarted)."""
        inner, index = self._inner, self._inner_shard
        self._inner = None
        self._actor.use(index, -1)
        if isinstance(exc, ClosedError):
            if self._actor.closed:
                raise exc  # the user closed the actor
            return  # the actor closed that connection (its shard was lost or restarted): open it again
        if isinstance(exc, ServerUnavailableError) and inner is not None and inner.in_doubt:
            first_time = index not in self.in_doubt_on
            self.in_doubt_on.append(index)
            if first_time:
                # The commit may have landed: ask the same shard once more (a new hello) before
                # moving on. The episode opened there again commits with the same key, and a
                # shard that applied it answers with its receipt. A shard that does not answer
                # the hello is marked down, and the episode moves on (then it may be held twice).
                self._actor.reconnect(index)
                return
        if isinstance(exc, SegmentStateError):
            if not self._actor.restarted(index):
                raise exc  # a refusal of this segment, not a lost server
            self._actor.reconnect(index)  # the same shard, a new process: open the episode there again
        else:
            self._actor.lose(index, exc)

    def commit(self) -> Receipt:
        """Send what is buffered, wait for every append, then commit on the current shard; on
        another shard when it stops answering. Returns after a shard has the episode in its file,
        flushed.

        Raises:
            ServerUnavailableError: no shard answers (the episode is lost).
        """
        self._require_open("commit")
        if self.length == 0:
            self._state = "committed"
            self.receipt = Receipt(-1, -1, 0)
            return self.receipt
        try:
            receipt: Receipt = self._attempt(_commit, rows=False)
        except BaseException:
            self._give_up()
            raise
        self._state, self.receipt, self.shard = "committed", receipt, self._inner_shard
        self._actor.use(self._inner_shard, -1)
        elsewhere = tuple(sorted(set(self.in_doubt_on) - {self._inner_shard}))
        if elsewhere:  # a lost commit on another shard may have landed there too
            self._actor.in_doubt.append(InDoubt(self.key, elsewhere, self._inner_shard, receipt))
        return receipt

    def _give_up(self) -> None:
        self._state = "failed"
        if self._inner is not None:
            self._inner = None
            self._actor.use(self._inner_shard, -1)

    def abort(self) -> None:
        """Drop the episode: nothing of it becomes visible. Safe to call twice."""
        if self._state != "open":
            return
        self._state = "aborted"
        self._rows = _Rows()
        if self._inner is not None:
            inner, self._inner = self._inner, None
            self._actor.use(self._inner_shard, -1)
            inner.abort()

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


# ==================================================================================== learners


