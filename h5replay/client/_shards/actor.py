"""ShardedActor: one home shard at a time, the episode in flight moved whole when a shard is lost,
an episode whose commit reply was lost kept and settled on that shard.

See the package's docstring (h5replay.client._shards) for the behaviour.
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Concatenate, Literal, NamedTuple, NoReturn, ParamSpec, Protocol, TypeVar, overload

import numpy as np

from h5replay.client._commits import PendingCommit
from h5replay.client._segment import ActorSegment, SegmentClient
from h5replay.client._shards._router import _Router, _Shard, home_shard, log
from h5replay.config import ClientConfig
from h5replay.errors import (
    ClosedError,
    CommitInDoubtError,
    ConfigError,
    H5ReplayError,
    SegmentStateError,
    ServerUnavailableError,
)
from h5replay.priorities import Given, PriorityColumns, one_row_priorities
from h5replay.protocol import IDEMPOTENCY_KEY_BYTES
from h5replay.records import Receipt

__all__ = ["InDoubt", "ShardedActor", "ShardedSegment", "ShardClient"]


class ShardClient(SegmentClient, Protocol):
    """What the router needs of one shard's single-server client (an ActorClient)."""

    def encode_one(self, step: Any) -> dict[str, np.ndarray]: ...

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]: ...

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None: ...

    def check_priorities(self, priorities: Any, n: int) -> Given | None: ...

    def info(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


_A = TypeVar("_A", bound=ShardClient)


def _done(receipt: Receipt) -> PendingCommit:
    """A settled PendingCommit: over several servers, commits are always waited for."""
    return PendingCommit.done_with(receipt)

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(method: Callable[Concatenate[ShardedActor[Any], _P], _R]) -> Callable[Concatenate[ShardedActor[Any], _P], _R]:
    """Run the method under the actor's lock: segments of one actor may be used from several threads."""
    def locked(self: ShardedActor[Any], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    functools.update_wrapper(locked, method)
    return locked


class InDoubt(NamedTuple):
    """An episode whose commit (or push) reply was lost with a shard that then did not answer
    again within the commit's time (its commit raised CommitInDoubtError). The actor keeps it and
    settles it on that shard, with its idempotency key, once the shard answers: never elsewhere,
    so it is held exactly once.

    Attributes:
        key: the episode's idempotency key (made once, sent again with every retry).
        shard: the shard the commit was sent to, where it is settled.
        length: its number of rows.
        receipt: that shard's receipt once settled (the original one if the lost commit had been
            applied); None while the shard has not answered.
    """

    key: bytes
    shard: int
    length: int
    receipt: Receipt | None


class _Rows:
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


class _Parked:
    """An episode in doubt on `shard`, kept here until that shard settles it."""

    def __init__(self, key: bytes, shard: int, rows: _Rows) -> None:
        self.key, self.shard, self.rows = key, shard, rows
        self.retry_at = 0.0  # monotonic seconds; after a refusal (rate limit, full disk), the next try

    def record(self, receipt: Receipt | None = None) -> InDoubt:
        return InDoubt(self.key, self.shard, self.rows.num_rows, receipt)


def _commit(segment: ActorSegment) -> Receipt:
    """Commit (or push) `segment` on its shard, with the episode's idempotency key (the segment
    was opened with ShardedSegment.key, the same on every retry).

    A server only remembers its own keys: a retry on *another* shard cannot be told apart from a
    first commit there. So an episode whose commit reply was lost is only ever retried on that
    shard (the segment's own retries, then ShardedSegment._lost), and kept by the actor, to be
    settled there, when that shard does not answer.
    """
    return segment.commit()


class ShardedActor(_Router[_A]):
    """The routing of `ActorClient(endpoints=[...])`: one shard at a time, failing over.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored; `name` picks the home shard).
        secret_key, server_key: CURVE certificate files, the same for every shard.
        client_class: the single-server client of one shard (ActorClient).

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    role = "actor"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _A],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class)
        self.home = home_shard(config.name, len(self.shards))
        self.current = self.home
        #: Episodes in doubt, by key, kept until their shard settles them.
        self._parked: dict[bytes, _Parked] = {}
        #: Episodes that were in doubt and are settled (the newest 1000).
        self._settled: deque[InDoubt] = deque(maxlen=1000)
        self.num_failovers = 0
        self._using: Counter[int] = Counter()  # open segments per shard
        self._codec: _A | None = None  # encodes steps (the space is every shard's)
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

    def _ring(self, start: int) -> list[_Shard]:
        return [self.shards[(start + k) % len(self.shards)] for k in range(len(self.shards))]

    def _wants_probe(self, shard: _Shard) -> bool:
        return (shard.index == self.home and self.current != self.home) or self._parked_on(shard.index)

    def _parked_on(self, index: int) -> bool:
        return any(p.shard == index for p in self._parked.values())

    @property
    def in_doubt(self) -> list[InDoubt]:
        """The episodes settled after being in doubt (newest 1000), then those still kept."""
        with self._lock:
            return [*self._settled, *(p.record() for p in self._parked.values())]

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
            if (shard.index != self.current and shard.client is not None and self._using[shard.index] <= 0
                    and not self._parked_on(shard.index)):
                client, shard.client = shard.client, None
                client.close()

    @property
    def codec(self) -> _A:
        if self._codec is None:
            raise ClosedError("this actor never connected")
        return self._codec

    @_locked
    def writer(self) -> tuple[int, _A]:
        """(shard, client) to write the next rows to: the current shard, or the next live one.

        Raises:
            ServerUnavailableError: no shard answers.
        """
        self._check()
        self._poll_probes()
        self._settle_due()
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
    def client_of(self, index: int) -> _A | None:
        """Shard `index`'s client while it answers, else None (an episode in doubt there may go
        nowhere else)."""
        self._check()
        self._poll_probes()
        client: _A | None = self.shards[index].client
        return client

    @_locked
    def park(self, key: bytes, index: int, rows: _Rows) -> None:
        """Keep an episode in doubt on shard `index` until that shard settles it."""
        self._parked[key] = _Parked(key, index, rows)
        log.warning("actor %s keeps an episode of %d rows in doubt on shard %d (%s) and commits it there with "
                    "its key when the shard answers again", self.config.name, rows.num_rows, index,
                    self.shards[index].endpoint)

    def _settle_due(self) -> None:
        """Settle the episodes in doubt on shards that answer: each committed there with its key."""
        now = time.monotonic()
        for parked in list(self._parked.values()):
            shard = self.shards[parked.shard]
            if shard.client is not None and parked.retry_at <= now:
                self._settle(parked, shard)

    def _settle(self, parked: _Parked, shard: _Shard) -> None:
        inner = ActorSegment(shard.client, key=parked.key)
        self._using[shard.index] += 1
        try:
            inner.extend_encoded(parked.rows.view(), parked.rows.num_rows, parked.rows.priorities())
            inner.set_final_encoded(parked.rows.final)
            receipt = inner.commit()
        except (ServerUnavailableError, ClosedError) as exc:
            self._mark_down(shard, exc)  # still in doubt there: probed, settled when it answers
            return
        except H5ReplayError as exc:  # refused for now (rate limit, full disk, ...): try again later
            parked.retry_at = time.monotonic() + self.config.shard_retry_interval
            log.warning("shard %d (%s) refused to settle an episode in doubt, trying again in %.1f s: %s",
                        shard.index, shard.endpoint, self.config.shard_retry_interval, exc)
            try:
                inner.abort()
            except H5ReplayError:
                pass
            return
        finally:
            self._using[shard.index] -= 1
        del self._parked[parked.key]
        self._settled.append(parked.record(receipt))
        log.warning("actor %s settled an episode in doubt on shard %d (%s): %s", self.config.name, shard.index,
                    shard.endpoint, receipt)

    def settle(self, timeout: float | None = None) -> list[InDoubt]:
        """Wait until every episode in doubt is settled on its shard, or `timeout` seconds
        (None: the client's timeout) passed. Returns those still in doubt."""
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        while True:
            with self._lock:
                self._check()
                self._poll_probes()
                self._settle_due()
                left = [p.record() for p in self._parked.values()]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def close(self) -> None:
        """Settle what is in doubt on shards that answer now (without waiting for the others:
        `settle(timeout)` first does), then close every shard's client. An episode still in doubt
        then is lost to this actor if its shard had not applied it: logged."""
        if self._parked and not self.closed and os.getpid() == self._pid:
            try:
                left = self.settle(0.0)
            except H5ReplayError as exc:
                left = [p.record() for p in self._parked.values()]
                log.error("settling the episodes in doubt failed: %s", exc)
            for record in left:
                log.error("actor %s closes with an episode of %d rows still in doubt on shard %d (%s): it is held "
                          "there only if that shard applied its commit", self.config.name, record.length,
                          record.shard, self.shards[record.shard].endpoint)
        super().close()

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

    def push_episode(self, batch: Any, priorities: Any = None, *, final: Any = None) -> Receipt:
        encoded, n = self.codec.encode_batch(batch)
        given = self.codec.check_priorities(priorities, n)
        if n == 0:
            return Receipt(-1, -1, 0)
        seg = ShardedSegment(self)
        seg.extend_encoded(encoded, n, given)
        return seg.commit(final=final)

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
        in_doubt_on: the shard where a commit of this episode was sent and no reply came back
            (None: none): from then on the episode goes to no other shard.
    """

    def __init__(self, actor: ShardedActor[Any]) -> None:
        self._actor = actor
        self._rows = _Rows()
        self._inner: ActorSegment | None = None
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

    def append(self, step: Any, priority: float | Mapping[str, float] | None = None) -> None:
        """Add one step (with its priority for every prioritized table, or by table name);
        checked now, sent soon."""
        self._require_open("append to")
        given = None if priority is None else self._actor.codec.check_priorities(one_row_priorities(priority), 1)
        self._add(self._actor.codec.encode_one(step), 1, given)

    def extend(self, batch: Any, priorities: Any = None) -> None:
        """Add a batch of steps (a leading axis on every leaf), with one priority per step if given."""
        self._require_open("extend")
        encoded, n = self._actor.codec.encode_batch(batch)
        self._add(encoded, n, self._actor.codec.check_priorities(priorities, n))

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`)."""
        self._require_open("extend")
        self._add(encoded, n, priorities)

    def _add(self, encoded: dict[str, np.ndarray], n: int, priorities: Given | None = None) -> None:
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
        while self._inner is None:
            if self.in_doubt_on is not None:  # its commit may have landed there: only there
                index, pinned = self.in_doubt_on, self._actor.client_of(self.in_doubt_on)
                if pinned is None:
                    self._park()
                client = pinned
            else:
                index, client = self._actor.writer()
            inner = ActorSegment(client, key=self.key)
            inner.set_final_encoded(self._rows.final)
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
            if self.in_doubt_on is None:
                # The commit may have landed: ask the same shard once more (a new hello). The
                # episode opened there again commits with the same key, and a shard that applied
                # it answers with its receipt. A shard that does not answer the hello is marked
                # down, and the actor keeps the episode (_open parks it).
                self.in_doubt_on = index
                self._actor.reconnect(index)
                return
            self._actor.lose(index, exc)
            self._park()
        if isinstance(exc, SegmentStateError):
            if not self._actor.restarted(index):
                raise exc  # a refusal of this segment, not a lost server
            self._actor.reconnect(index)  # the same shard, a new process: open the episode there again
        else:
            self._actor.lose(index, exc)

    def set_final(self, final: Any) -> None:
        """The observation after the episode's last step, as `ActorSegment.set_final` takes it:
        sent with the commit, to whichever shard takes the episode."""
        self._require_open("set the final observation of")
        self._rows.final = self._actor.codec.encode_final(final)
        if self._inner is not None:
            self._inner.set_final_encoded(self._rows.final)

    @overload
    def commit(self, *, wait: Literal[True] = True, final: Any = None) -> Receipt: ...
    @overload
    def commit(self, *, wait: Literal[False], final: Any = None) -> PendingCommit: ...

    def commit(self, *, wait: bool = True, final: Any = None) -> Receipt | PendingCommit:
        """Send what is buffered, wait for every append, then commit on the current shard; on
        another shard when it stops answering. Returns after a shard has the episode in its file,
        flushed. Over several servers a commit is always waited for: with `wait=False` (as for
        one server) a done `PendingCommit` is returned.

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
            return receipt if wait else _done(receipt)
        try:
            receipt = self._attempt(_commit, rows=False)
        except BaseException:
            self._give_up()
            raise
        self._state, self.receipt, self.shard = "committed", receipt, self._inner_shard
        self._actor.use(self._inner_shard, -1)
        return receipt if wait else _done(receipt)

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


