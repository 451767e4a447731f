"""ShardedActor: one home shard at a time, the episode in flight moved whole when a shard is lost,
an episode whose commit reply was lost kept and settled on that shard.

See the package's docstring (h5replay.client._shards) for the behaviour. The routing is plans of
`ActorRouting` (each shard client's verb a `Call`), run by the blocking `ShardedActor` here and by
the asyncio `AsyncShardedActor` (h5replay.client.aio._shard_actor).
"""

from __future__ import annotations

import functools
import os
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from h5replay.client._shards._router import ActorPlan, Call, Pause, _Router, _Shard, home_shard, log
from h5replay.client._shards.segment import Rows, ShardedSegment
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ConfigError, H5ReplayError, ServerUnavailableError
from h5replay.priorities import Given
from h5replay.records import Receipt

__all__ = ["ActorRouting", "InDoubt", "ShardedActor", "ShardedSegment", "ShardClient"]

T = TypeVar("T")


class ShardClient(Protocol):
    """What the router needs of one shard's single-server client (an ActorClient or an
    AsyncActorClient) without waiting; its verbs (`info`, a segment's) it reaches untyped."""

    instance_id: str

    def encode_one(self, step: Any) -> dict[str, np.ndarray]: ...

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]: ...

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None: ...

    def check_priorities(self, priorities: Any, n: int) -> Given | None: ...


_A = TypeVar("_A", bound=ShardClient)


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


class _Parked:
    """An episode in doubt on `shard`, kept here until that shard settles it."""

    def __init__(self, key: bytes, shard: int, rows: Rows) -> None:
        self.key, self.shard, self.rows = key, shard, rows
        self.retry_at = 0.0  # monotonic seconds; after a refusal (rate limit, full disk), the next try

    def record(self, receipt: Receipt | None = None) -> InDoubt:
        return InDoubt(self.key, self.shard, self.rows.num_rows, receipt)


class ActorRouting(_Router[_A]):
    """The routing of an actor over several servers: one shard at a time, failing over; as plans
    (`ActorPlan`) that a driver runs (`run`): the blocking `ShardedActor`, the asyncio
    `AsyncShardedActor`. Only how a shard's client is made (`_new_client`) and how plans run differ.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored; `name` picks the home shard).
        secret_key, server_key: CURVE certificate files, the same for every shard.
        client_class: the single-server client of one shard (ActorClient, AsyncActorClient).
        segment_class: a segment of one shard's client (ActorSegment, AsyncActorSegment).
    """

    role = "actor"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _A], segment_class: Callable[..., Any],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class)
        self._segment_class = segment_class
        self.home = home_shard(config.name, len(self.shards))
        self.current = self.home
        #: Episodes in doubt, by key, kept until their shard settles them.
        self._parked: dict[bytes, _Parked] = {}
        #: Episodes that were in doubt and are settled (the newest 1000).
        self._settled: deque[InDoubt] = deque(maxlen=1000)
        self.num_failovers = 0
        self._using: Counter[int] = Counter()  # open segments per shard
        self._codec: _A | None = None  # encodes steps (the space is every shard's)

    def _after_hellos(self) -> None:
        """After the first hellos (one to every shard, so that a space mismatch shows now and not
        at a failover): only the shard written to keeps a connection (a server's client slots are few)."""
        self._codec = next(s.client for s in self.shards if s.client is not None)
        live = [s for s in self.shards if s.client is not None]
        self.current = next(s.index for s in self._ring(self.home) if s.client is not None)
        for shard in live:
            if shard.index != self.current:
                client, shard.client = shard.client, None
                self._close_client(client)

    def _new_client(self, endpoint: str) -> Any:
        """A connected client of `endpoint` (or an awaitable of it)."""
        return self._make(endpoint)

    def new_segment(self, client: Any, key: bytes) -> Any:
        """A segment of one shard's client, opened with the episode's key."""
        return self._segment_class(client, key=key)

    def run(self, plan: ActorPlan[T]) -> Any:
        """The plan's result (a driver's: the blocking router returns it, the asyncio one an awaitable)."""
        raise NotImplementedError

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
                self._close_client(client)

    @property
    def codec(self) -> _A:
        if self._codec is None:
            raise ClosedError("this actor never connected")
        return self._codec

    def writer_plan(self) -> ActorPlan[tuple[int, Any]]:
        """(shard, client) to write the next rows to: the current shard, or the next live one.

        Raises:
            ServerUnavailableError: no shard answers.
        """
        self._check()
        self._poll_probes()
        yield from self._settle_due()
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
                client = yield Call(functools.partial(self._new_client, candidate.endpoint))
            except ServerUnavailableError as exc:
                self._mark_down(candidate, exc)
                errors.append(f"{candidate.endpoint}: {exc}")
                continue
            if candidate.client is not None:  # (asyncio) made meanwhile by another call
                self._close_client(client)
                client = candidate.client
            try:
                self._admit(candidate, client)
            except ConfigError as exc:
                self._close_client(client)
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

    def client_of(self, index: int) -> _A | None:
        """Shard `index`'s client while it answers, else None (an episode in doubt there may go
        nowhere else)."""
        self._check()
        self._poll_probes()
        client: _A | None = self.shards[index].client
        return client

    def park(self, key: bytes, index: int, rows: Rows) -> None:
        """Keep an episode in doubt on shard `index` until that shard settles it."""
        self._parked[key] = _Parked(key, index, rows)
        log.warning("actor %s keeps an episode of %d rows in doubt on shard %d (%s) and commits it there with "
                    "its key when the shard answers again", self.config.name, rows.num_rows, index,
                    self.shards[index].endpoint)

    def _settle_due(self) -> ActorPlan[None]:
        """Settle the episodes in doubt on shards that answer: each committed there with its key."""
        now = time.monotonic()
        for parked in list(self._parked.values()):
            shard = self.shards[parked.shard]
            if shard.client is not None and parked.retry_at <= now and parked.key in self._parked:
                yield from self._settle(parked, shard)

    def _settle(self, parked: _Parked, shard: _Shard) -> ActorPlan[None]:
        inner = self.new_segment(shard.client, parked.key)
        self._using[shard.index] += 1
        rows, n, given = parked.rows.view(), parked.rows.num_rows, parked.rows.priorities()
        try:
            yield Call(lambda: inner.extend_encoded(rows, n, given))
            inner.set_final_encoded(parked.rows.final)
            receipt = yield Call(inner.commit)
        except (ServerUnavailableError, ClosedError) as exc:
            self._mark_down(shard, exc)  # still in doubt there: probed, settled when it answers
            return
        except H5ReplayError as exc:  # refused for now (rate limit, full disk, ...): try again later
            parked.retry_at = time.monotonic() + self.config.shard_retry_interval
            log.warning("shard %d (%s) refused to settle an episode in doubt, trying again in %.1f s: %s",
                        shard.index, shard.endpoint, self.config.shard_retry_interval, exc)
            try:
                yield Call(inner.abort)
            except H5ReplayError:
                pass
            return
        finally:
            self._using[shard.index] -= 1
        del self._parked[parked.key]
        self._settled.append(parked.record(receipt))
        log.warning("actor %s settled an episode in doubt on shard %d (%s): %s", self.config.name, shard.index,
                    shard.endpoint, receipt)

    def settle_plan(self, timeout: float | None = None) -> ActorPlan[list[InDoubt]]:
        """Wait until every episode in doubt is settled on its shard, or `timeout` seconds
        (None: the client's timeout) passed. Returns those still in doubt."""
        deadline = time.monotonic() + (self.config.timeout if timeout is None else timeout)
        while True:
            self._check()
            self._poll_probes()
            yield from self._settle_due()
            left = [p.record() for p in self._parked.values()]
            if not left or time.monotonic() >= deadline:
                return left
            yield Pause(min(0.05, max(0.0, deadline - time.monotonic())))

    def _closing_plan(self) -> ActorPlan[None]:
        """Before closing: settle what is in doubt on shards that answer now (without waiting for
        the others: `settle(timeout)` first does). An episode still in doubt then is lost to this
        actor if its shard had not applied it: logged."""
        if not self._parked or self.closed or os.getpid() != self._pid:
            return
        try:
            left = yield from self.settle_plan(0.0)
        except H5ReplayError as exc:
            left = [p.record() for p in self._parked.values()]
            log.error("settling the episodes in doubt failed: %s", exc)
        for record in left:
            log.error("actor %s closes with an episode of %d rows still in doubt on shard %d (%s): it is held "
                      "there only if that shard applied its commit", self.config.name, record.length,
                      record.shard, self.shards[record.shard].endpoint)

    def lose(self, index: int, exc: BaseException) -> None:
        """Shard `index` stopped answering while this actor wrote to it."""
        shard = self.shards[index]
        if shard.client is not None:
            self._mark_down(shard, exc)

    def restarted_plan(self, index: int) -> ActorPlan[bool]:
        """Whether shard `index` is another server process than the one this actor said hello to
        (a restart quicker than the timeout: the new process knows none of the old one's segments)."""
        shard = self.shards[index]
        if shard.client is None:
            return True
        client: Any = shard.client
        try:
            stats = yield Call(client.info)
        except ServerUnavailableError as exc:
            self._mark_down(shard, exc)
            return True
        return bool(stats.get("instance_id") != client.instance_id)

    def reconnect_plan(self, index: int) -> ActorPlan[None]:
        """Say hello again to shard `index` (after a restart); marks it down if it does not answer."""
        shard = self.shards[index]
        if shard.client is not None:
            client, shard.client = shard.client, None
            self._close_client(client)
        try:
            client = yield Call(lambda: self._new_client(shard.endpoint))
        except ServerUnavailableError as exc:
            self._mark_down(shard, exc)
            return
        try:
            self._admit(shard, client)
        except ConfigError as exc:
            self._close_client(client)
            self._mark_down(shard, exc)

    def push_episode_plan(self, seg: Any, batch: Any, priorities: Any = None, final: Any = None) -> ActorPlan[Receipt]:
        """Push one episode through the fresh segment `seg` (a SegmentRouting of this actor)."""
        encoded, n = self.codec.encode_batch(batch)
        given = self.codec.check_priorities(priorities, n)
        if n == 0:
            return Receipt(-1, -1, 0)
        yield from seg.add_plan(encoded, n, given)
        return (yield from seg.commit_plan(final))  # type: ignore[no-any-return]

    def info_plan(self) -> ActorPlan[dict[str, Any]]:
        """The current shard's figures, with "shard": its index."""
        index, client = yield from self.writer_plan()
        try:
            return {**(yield Call(client.info)), "shard": index}
        except ServerUnavailableError as exc:
            self.lose(index, exc)
            raise


class ShardedActor(ActorRouting[_A]):
    """The routing of `ActorClient(endpoints=[...])`: one shard at a time, failing over; calls of
    one actor (its segments' too, from any thread) run one at a time, under a lock.

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _A], segment_class: Callable[..., Any],
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key, client_class=client_class,
                         segment_class=segment_class)
        try:
            self._connect_initial()
            self._after_hellos()
        except BaseException:
            self.close()
            raise

    def run(self, plan: ActorPlan[T]) -> T:
        """The plan's result, each Call made here in turn; the lock is let go while it pauses."""
        lock = self._lock
        with lock:
            value: Any = None
            error: BaseException | None = None
            while True:
                try:
                    op = plan.send(value) if error is None else plan.throw(error)
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                value, error = None, None
                try:
                    if isinstance(op, Call):
                        value = op.fn()
                    else:
                        lock.release()
                        try:
                            time.sleep(op.seconds)
                        finally:
                            lock.acquire()
                except BaseException as exc:  # noqa: B036 (thrown into the plan, which decides)
                    error = exc

    def writer(self) -> tuple[int, _A]:
        return self.run(self.writer_plan())

    def settle(self, timeout: float | None = None) -> list[InDoubt]:
        return self.run(self.settle_plan(timeout))

    def segment(self) -> ShardedSegment:
        self._check()
        return ShardedSegment(self)

    def push_episode(self, batch: Any, priorities: Any = None, *, final: Any = None) -> Receipt:
        return self.run(self.push_episode_plan(ShardedSegment(self), batch, priorities, final))

    def info(self) -> dict[str, Any]:
        return self.run(self.info_plan())

    def close(self) -> None:
        """Settle what is in doubt on shards that answer now, then close every shard's client.
        Safe to call twice."""
        if not self.closed and os.getpid() == self._pid:
            self.run(self._closing_plan())
        super().close()
