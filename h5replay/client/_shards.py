"""Clients over several servers ("shards"): actors that stick to one shard, learners that read all.

Each shard is an ordinary h5replay server owning its own file; shards know nothing of each other
(Reverb's model: no replication, no cross-shard transaction). All routing lives here, in the
client, over the ordinary single-server clients: `ActorClient(endpoints=[...])` and
`LearnerClient(endpoints=[...])` build a `ShardedActor` / `ShardedLearner` and delegate to it.

A shard is named by its index in `endpoints` (the same list, in the same order, for every client)
and told apart from the others by its file's `replay_id`. Row and episode ids are qualified by it:
`SampleInfo.shard_ids`, and a packed uint64 ``shard << 48 | id`` (h5replay.records.pack_ids).

Actors: an actor writes to its home shard, `crc32(name) % num_shards` (the same in every process
and on every machine, unlike Python's salted hash()). When that shard stops answering, the
episode in flight is opened again on the next live shard and every row of it so far is streamed
there again: the client keeps a copy of the episode's rows until its commit is acknowledged (one
extra copy of the current episode in the actor's memory). While away, the actor probes its home
shard in a background thread every `shard_retry_interval` seconds and goes back between two
episodes once it answers. A commit whose reply was lost with the shard may or may not have been
applied there: the episode is "in doubt", pushed again whole on the next live shard, and recorded
in `ActorClient.in_doubt` (see `_commit` for the idempotency key that is to settle it).

Learners: `sample(n)` splits the batch over the live shards in proportion to the rows each holds
(a multinomial draw, so the union is sampled uniformly), sends one request to every shard at once
(one thread per shard: zmq and numpy release the GIL) and puts the answers back together in the
order of the draw. `len`, `info` and `episodes` add the shards up. A shard that does not answer is
skipped with a warning (logged once when it goes down) and counted per call
(`ShardedLearner.num_skipped`); it is probed in the background and used again once it answers.
When no shard answers a call raises ServerUnavailableError.

Threads: the per-shard clients are made in worker threads (initial hellos in parallel, probes in
the background) and then used by whichever thread holds the router's lock; each hand-over goes
through a Future, a full memory barrier, which is what zmq asks of a socket changing threads.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import logging
import os
import threading
import time
import uuid
import zlib
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from h5replay.config import ClientConfig
from h5replay.errors import (
    ClosedError,
    ConfigError,
    EvictedError,
    NotEnoughDataError,
    SegmentStateError,
    ServerUnavailableError,
)
from h5replay.records import Episode, Receipt, SampleInfo, pack_ids, unpack_ids
from h5replay.storage.spaces import Space, flatten_value, unflatten_value

if TYPE_CHECKING:
    from h5replay.client.actor import ActorClient, ActorSegment
    from h5replay.client.learner import LearnerClient, View

__all__ = ["ShardedActor", "ShardedLearner", "ShardedSegment", "InDoubt", "home_shard", "MAX_SHARDS"]

log = logging.getLogger("h5replay.client")

MAX_SHARDS = 1 << 16  # a packed id has 16 bits of shard

# Figures of `info()` that do not add up across shards (they stay per shard, under "shards").
_NOT_ADDITIVE = frozenset({
    "seq", "generation", "oldest_row_id", "uptime", "replay_id", "instance_id", "server_version",
    "protocol_version", "capacity",
})


def home_shard(name: str, num_shards: int) -> int:
    """The shard an actor called `name` writes to while it answers: crc32 of the name, modulo the
    number of shards (stable across processes and machines, unlike the salted built-in hash())."""
    return zlib.crc32(name.encode("utf-8")) % num_shards


class InDoubt(NamedTuple):
    """An episode whose commit (or push) reply was lost with its shard: it may also be held there.

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


class _Shard:
    """One endpoint and what this client knows of it."""

    def __init__(self, index: int, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.client: Any = None  # an ActorClient / LearnerClient while it is in use
        self.replay_id: str | None = None  # its file's id, once it answered
        self.retry_at = 0.0  # down until then (monotonic seconds); 0: not known to be down
        self.probe: cf.Future[Any] | None = None  # a background hello while it is down
        self.num_down = 0  # times it was found unavailable


def _outcome(future: cf.Future[Any]) -> Any:
    """The future's result, or the exception it raised (returned, not raised)."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: B036 (handed back to the caller, who re-raises what it does not handle)
        return exc


class _Router:
    """What both sharded clients share: the shards, their space and ids, going down, coming back."""

    role = "client"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None
    ) -> None:
        if isinstance(endpoints, str):
            raise ConfigError(f"endpoints must be a list of endpoints, not the string {endpoints!r}")
        endpoints = list(endpoints)
        if not endpoints:
            raise ConfigError("endpoints is empty: give the endpoint of every shard (server)")
        if len(endpoints) > MAX_SHARDS:
            raise ConfigError(f"{len(endpoints)} endpoints: at most {MAX_SHARDS} shards fit a packed id")
        twice = sorted({e for e in endpoints if endpoints.count(e) > 1})
        if twice:
            raise ConfigError(f"endpoints lists {twice} more than once; list every shard once")
        for endpoint in endpoints:
            dataclasses.replace(config, endpoint=endpoint)  # validates the endpoint's form now
        self.config = config
        self.endpoints = endpoints
        self.shards = [_Shard(i, e) for i, e in enumerate(endpoints)]
        self.space: Space | None = None
        self._keys = (secret_key, server_key)
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._closed = False
        self._probes = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5replay-probe")

    # ------------------------------------------------------------------ hooks

    def _make(self, endpoint: str) -> Any:
        """A single-server client of `endpoint` (says hello; blocks up to the timeout)."""
        raise NotImplementedError

    def _wants_probe(self, shard: _Shard) -> bool:
        return True

    def _adopted(self, shard: _Shard) -> None:
        """`shard` answered a probe and is usable again."""

    def _retire(self, shard: _Shard) -> None:
        """`shard.client` is about to be closed."""

    # ------------------------------------------------------------------ shards coming and going

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"this {self.role} over {len(self.shards)} shards was closed")
        if os.getpid() != self._pid:
            raise ClosedError("a client cannot be used across fork; create it in the child process")

    def _connect_initial(self) -> None:
        """Say hello to every shard at once; every shard that answers must hold the same space.

        Raises:
            ConfigError: two shards hold different spaces, or two endpoints reach the same file.
            ServerUnavailableError: no shard answered within the timeout.
        """
        with cf.ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="h5replay-hello") as pool:
            futures = [pool.submit(self._make, shard.endpoint) for shard in self.shards]
            outcomes = [_outcome(f) for f in futures]
        try:
            for shard, outcome in zip(self.shards, outcomes):
                if isinstance(outcome, ServerUnavailableError):
                    self._mark_down(shard, outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome
                else:
                    self._admit(shard, outcome)
        except BaseException:
            for outcome in outcomes:
                if not isinstance(outcome, BaseException):
                    outcome.close()
            raise
        if all(shard.client is None for shard in self.shards):
            raise ServerUnavailableError(
                f"none of the {len(self.shards)} shards answered within {self.config.timeout} s: "
                f"{', '.join(self.endpoints)}"
            )

    def _admit(self, shard: _Shard, client: Any) -> None:
        """Use `client` for `shard`, after checking its space and its file's id.

        Raises:
            ConfigError: another space than the other shards', the replay of another endpoint, or
                another file than the one this shard had (its row ids would mean other rows).
        """
        if self.space is None:
            self.space = client.space
        elif client.space != self.space:
            first = next(s for s in self.shards if s.replay_id is not None)
            raise ConfigError(
                f"the server at {shard.endpoint} holds {client.space!r}, but the one at {first.endpoint} holds "
                f"{self.space!r}; every shard must hold the same space"
            )
        if shard.replay_id is not None and client.replay_id != shard.replay_id:
            raise ConfigError(
                f"shard {shard.index} at {shard.endpoint} now serves another file (replay_id {client.replay_id}, was "
                f"{shard.replay_id}); its row ids would name other rows, so it is not used again by this client"
            )
        for other in self.shards:
            if other is not shard and other.replay_id == client.replay_id:
                raise ConfigError(
                    f"{shard.endpoint} and {other.endpoint} serve the same replay (replay_id {client.replay_id}); "
                    "list every shard once"
                )
        shard.client, shard.replay_id, shard.retry_at = client, client.replay_id, 0.0

    def _mark_down(self, shard: _Shard, exc: BaseException) -> None:
        """`shard` did not answer: stop using it, try it again after `shard_retry_interval`."""
        if shard.client is not None:
            self._retire(shard)
            client, shard.client = shard.client, None
            client.close()
        shard.num_down += 1
        shard.retry_at = time.monotonic() + self.config.shard_retry_interval
        log.warning("shard %d (%s) is unavailable, skipping it and trying it again every %.1f s: %s",
                    shard.index, shard.endpoint, self.config.shard_retry_interval, exc)

    def _poll_probes(self) -> None:
        """Adopt the shards whose background hello answered; start probes of those due one."""
        now = time.monotonic()
        for shard in self.shards:
            if shard.client is not None:
                continue
            if shard.probe is not None and shard.probe.done():
                outcome, shard.probe = _outcome(shard.probe), None
                if isinstance(outcome, BaseException):
                    shard.retry_at = now + self.config.shard_retry_interval
                    continue
                try:
                    self._admit(shard, outcome)
                except ConfigError as exc:
                    log.error("%s", exc)
                    outcome.close()
                    shard.retry_at = now + self.config.shard_retry_interval
                    continue
                log.warning("shard %d (%s) answers again", shard.index, shard.endpoint)
                self._adopted(shard)
            elif shard.probe is None and shard.retry_at and now >= shard.retry_at and self._wants_probe(shard):
                shard.probe = self._probes.submit(self._make, shard.endpoint)

    def close(self) -> None:
        """Close every shard's client; a probe still running closes its own when it ends. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for shard in self.shards:
                if shard.probe is not None:
                    shard.probe.add_done_callback(_close_result)
                    shard.probe = None
                if shard.client is not None and os.getpid() == self._pid:
                    client, shard.client = shard.client, None
                    client.close()
            self._probes.shutdown(wait=False, cancel_futures=True)

    def _client_kwargs(self, endpoint: str) -> dict[str, Any]:
        return {"config": dataclasses.replace(self.config, endpoint=endpoint),
                "secret_key": self._keys[0], "server_key": self._keys[1]}


def _close_result(future: cf.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is None:
        future.result().close()


# ====================================================================================== actors


class _Rows:
    """Every row of the episode so far (storage form), kept until its commit is acknowledged."""

    def __init__(self) -> None:
        self._arrays: dict[str, np.ndarray] = {}
        self.num_rows = 0

    def add(self, encoded: Mapping[str, np.ndarray], n: int) -> None:
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


def _commit(segment: ActorSegment, key: bytes) -> Receipt:
    """Commit (or push) `segment` on its shard.

    IDEMPOTENCY KEY (issue 14), to wire after the merge: send `key` as the commit's / push's
    `idempotency_key`. The key is made once per episode (ShardedSegment.key) and is the same on
    every retry of that episode, on this shard or on another. Note that a server only remembers
    its own keys: a retry on *another* shard cannot be told apart from a first commit there. For
    "never stored twice" an in-doubt episode must be retried with its key on the shard that lost
    the reply (see ShardedSegment._lost) before it moves on.
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

    def lose(self, index: int, exc: BaseException) -> None:
        """Shard `index` stopped answering while this actor wrote to it."""
        shard = self.shards[index]
        if shard.client is not None:
            self._mark_down(shard, exc)

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

    def push_episode(self, batch: Any) -> Receipt:
        encoded, n = self.codec.encode_batch(batch)
        if n == 0:
            return Receipt(-1, -1, 0)
        seg = ShardedSegment(self)
        seg.extend_encoded(encoded, n)
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
        self.key = uuid.uuid4().bytes
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

    def append(self, step: Any) -> None:
        """Add one step; checked against the space now, sent in a batch soon."""
        self._require_open("append to")
        self._add(self._actor.codec.encode_one(step), 1)

    def extend(self, batch: Any) -> None:
        """Add a batch of steps (a leading axis on every leaf)."""
        self._require_open("extend")
        encoded, n = self._actor.codec.encode_batch(batch)
        self._add(encoded, n)

    def extend_encoded(self, encoded: dict[str, np.ndarray], n: int) -> None:
        """Add rows already checked and in storage form (from `ActorClient.encode_batch`)."""
        self._require_open("extend")
        self._add(encoded, n)

    def _add(self, encoded: dict[str, np.ndarray], n: int) -> None:
        if n == 0:
            return
        self._rows.add(encoded, n)
        self.length += n
        try:
            self._attempt(lambda inner: inner.extend_encoded(encoded, n), rows=True)
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
            inner = ActorSegment(client)
            self._inner, self._inner_shard = inner, index
            self._actor.use(index, +1)
            if self._rows.num_rows:
                try:
                    inner.extend_encoded(self._rows.view(), self._rows.num_rows)
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
        # "failed" is the state of a segment whose commit (or push) was sent without a reply.
        if isinstance(exc, ServerUnavailableError) and inner is not None and getattr(inner, "_state", None) == "failed":
            self.in_doubt_on.append(index)
            # To wire with issue 14's idempotency keys: retry `_commit(..., self.key)` on shard `index`
            # first (for as long as it may come back), and only then move on; today the episode goes to
            # the next live shard at once and may end up held twice.
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
            receipt: Receipt = self._attempt(lambda inner: _commit(inner, self.key), rows=False)
        except BaseException:
            self._give_up()
            raise
        self._state, self.receipt, self.shard = "committed", receipt, self._inner_shard
        self._actor.use(self._inner_shard, -1)
        if self.in_doubt_on:
            self._actor.in_doubt.append(InDoubt(self.key, tuple(self.in_doubt_on), self._inner_shard, receipt))
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


def _qualified(row_ids: Any, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local id) arrays from packed ids (1-D) or (shard, id) pairs (shape (n, 2)).

    Raises:
        TypeError: not integers.
        IndexError: a negative id or pair, or a shard this learner does not have.
    """
    arr = row_ids if isinstance(row_ids, np.ndarray) else np.asarray(row_ids)
    if arr.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers (packed ids, or (shard, row_id) pairs), got an array of {arr.dtype}")
    if arr.ndim == 2 and arr.shape[1] == 2:
        if int(arr.min()) < 0:
            raise IndexError(f"(shard, row_id) pairs cannot be negative, got {int(arr.min())}")
        shards, local = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64)
    elif arr.ndim == 1:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise IndexError(f"packed row id {int(arr.min())} is negative")
        shards, ids = unpack_ids(arr)
        local = ids.astype(np.int64)
    else:
        raise TypeError(f"row ids must be packed ids (shape (n,)) or (shard, row_id) pairs (shape (n, 2)), "
                        f"got shape {arr.shape}")
    if int(shards.max()) >= num_shards:
        raise IndexError(f"shard {int(shards.max())} does not exist: this learner has {num_shards} shard(s)")
    return shards, local


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


class _Empty(Exception):
    """A shard had nothing to sample (it was cleared, or holds no window that long)."""


class ShardedLearner(_Router):
    """The routing of `LearnerClient(endpoints=[...])`: reads from every live shard.

    Args:
        endpoints: every shard's endpoint, in the same order for every client.
        config: the client's settings (its `endpoint` is ignored).
        secret_key, server_key: CURVE certificate files, the same for every shard.

    Raises:
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    role = "learner"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None
    ) -> None:
        super().__init__(endpoints, config, secret_key, server_key)
        self._pool = cf.ThreadPoolExecutor(max_workers=len(self.shards), thread_name_prefix="h5replay-shard")
        self._lengths = np.full(len(self.shards), -1, dtype=np.int64)  # rows held as last seen; -1: unknown
        self._views: dict[int, View] = {}  # kept while a shard is down: its view never goes back
        #: Calls that skipped each shard because it was down.
        self.num_skipped = [0] * len(self.shards)
        self._rng = np.random.default_rng()  # splits batches when the caller gives no seed
        try:
            self._connect_initial()
        except BaseException:
            self.close()
            raise
        first = next(s.client for s in self.shards if s.client is not None)
        self.limits = first.limits
        self.codec_space: Space = first.space

    def _make(self, endpoint: str) -> LearnerClient:
        from h5replay.client.learner import LearnerClient

        return LearnerClient(**self._client_kwargs(endpoint))

    def _retire(self, shard: _Shard) -> None:
        view = shard.client.view
        if view is not None:
            self._views[shard.index] = view
        self._lengths[shard.index] = -1

    def _adopted(self, shard: _Shard) -> None:
        view = self._views.pop(shard.index, None)
        if view is not None and shard.client.view is None:
            # The restarted server publishes states newer than any this client saw: min_seq stays valid.
            shard.client._view = view

    @property
    def capacity(self) -> int | None:
        """Rows all shards hold together when full (None when one grows without limit); of the
        shards that answered so far."""
        capacities = [s.client.capacity for s in self.shards if s.client is not None]
        return None if any(c is None for c in capacities) else int(sum(capacities))

    @property
    def views(self) -> tuple[View | None, ...]:
        """The newest published state each shard's replies came from (None before any read)."""
        return tuple(s.client.view if s.client is not None else self._views.get(s.index) for s in self.shards)

    @property
    def live_shards(self) -> list[int]:
        """The shards in use now (a down shard comes back once its background probe answers)."""
        return [s.index for s in self.shards if s.client is not None]

    # ------------------------------------------------------------------ fan-out

    def _live(self) -> list[int]:
        self._check()
        self._poll_probes()
        live = []
        for shard in self.shards:
            if shard.client is None:
                self.num_skipped[shard.index] += 1
            else:
                live.append(shard.index)
        if not live:
            raise ServerUnavailableError(
                f"all {len(self.shards)} shards are unavailable (each is tried again every "
                f"{self.config.shard_retry_interval} s): {', '.join(self.endpoints)}"
            )
        return live

    def _fan_out(self, calls: Mapping[int, Callable[[LearnerClient], Any]]) -> dict[int, Any]:
        """{shard: result} of one call per shard, all sent at once. A shard that does not answer is
        marked down and left out; any other error is raised (after every call has returned)."""
        # All but the last go to the pool; the last runs in this thread meanwhile (one hand-over less).
        *others, (last, last_call) = calls.items()
        futures: dict[int, Any] = {i: self._pool.submit(call, self.shards[i].client) for i, call in others}
        futures[last] = _run_inline(last_call, self.shards[last].client)
        results: dict[int, Any] = {}
        error: BaseException | None = None
        for index, future in futures.items():
            outcome = _outcome(future)
            if isinstance(outcome, ServerUnavailableError):
                self._mark_down(self.shards[index], outcome)
            elif isinstance(outcome, BaseException):
                error = error or outcome
            else:
                results[index] = outcome
        if error is not None:
            raise error
        return results

    def _gather(self, call: Callable[[LearnerClient], Any]) -> dict[int, Any]:
        """`call` on every live shard; raises ServerUnavailableError when none answered."""
        with self._lock:
            results = self._fan_out({i: call for i in self._live()})
            if not results:
                raise ServerUnavailableError(f"no shard of {len(self.shards)} answered within {self.config.timeout} s")
            return results

    # ------------------------------------------------------------------ figures

    def __len__(self) -> int:
        results = self._gather(len)
        for index, length in results.items():
            self._lengths[index] = length
        return int(sum(results.values()))

    def info(self) -> dict[str, Any]:
        """The shards' figures added up (rows, episodes, rows in and out, commits, ...), with
        "shards": each shard's own figures (None for a shard that did not answer), "num_shards",
        "live_shards" and "skipped" (calls that skipped each shard)."""
        results = self._gather(lambda c: c.info())
        per_shard = [results.get(s.index) for s in self.shards]
        answered = [r for r in per_shard if r is not None]
        total: dict[str, Any] = {}
        for key in answered[0]:
            values = [r.get(key) for r in answered]
            if key not in _NOT_ADDITIVE and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                total[key] = sum(values)
        capacities = [r.get("capacity") for r in answered]
        total["capacity"] = None if None in capacities else sum(capacities)
        for index, stats in results.items():
            self._lengths[index] = int(stats.get("length", 0))
        total.update(num_shards=len(self.shards), live_shards=sorted(results), skipped=list(self.num_skipped),
                     shards=per_shard)
        return total

    def episodes(self) -> list[Episode]:
        """Every complete episode held on every live shard (shard by shard, oldest first), with
        packed ids: Episode(pack_ids(shard, episode_id), pack_ids(shard, first_row_id), length)."""
        results = self._gather(lambda c: c.episodes())
        out: list[Episode] = []
        for index in sorted(results):
            eps = results[index]
            if not eps:
                continue
            table = np.asarray(eps, dtype=np.uint64).reshape(-1, 3)
            ids, firsts = pack_ids(index, table[:, 0]), pack_ids(index, table[:, 1])
            out.extend(Episode(int(e), int(f), int(n)) for e, f, n in zip(ids, firsts, table[:, 2]))
        return out

    # ------------------------------------------------------------------ reads

    def _flat(self, batch: Any) -> dict[str, Any]:
        if self.space is None:
            raise ClosedError("this learner never connected")
        return flatten_value(self.space, batch)

    def _unflat(self, leaves: Mapping[str, Any]) -> Any:
        if self.space is None:
            raise ClosedError("this learner never connected")
        return unflatten_value(self.space, leaves)

    def get_rows(self, row_ids: Any) -> Any:
        """Rows by qualified id, any order, duplicates kept; returned flat (n, ...).

        Args:
            row_ids: packed ids (`pack_ids(shard, row_id)`, `SampleInfo.packed_row_ids`, the ids of
                `episodes()`), or an (n, 2) array of (shard, row_id) pairs.

        Raises:
            ServerUnavailableError: a shard named does not answer.
            EvictedError: an id is no longer held (the message names the shard and the id).
            IndexError: an id was never committed, or names a shard this learner does not have.
            TypeError: the ids are not integers.
        """
        shards, local = _qualified(row_ids, len(self.shards))
        with self._lock:
            self._live()
            wanted = np.unique(shards) if shards.size else np.zeros(1, np.int64)
            for index in wanted.tolist():
                if self.shards[index].client is None:
                    raise ServerUnavailableError(f"shard {index} ({self.endpoints[index]}) is unavailable; its rows "
                                                 "cannot be read until it answers again")
            masks = {index: shards == index for index in wanted.tolist()}
            calls = {index: _reader(index, local[mask]) for index, mask in masks.items()}
            results = self._fan_out(calls)
            missing = sorted(set(calls) - set(results))
            if missing:
                raise ServerUnavailableError(f"shard(s) {missing} did not answer within {self.config.timeout} s")
        parts = {index: self._flat(batch) for index, batch in results.items()}
        return self._unflat(_scatter(parts, masks, local.shape[0]))

    def get(self, indices: Any) -> Any:
        raise NotImplementedError(
            "get() reads logical positions of one buffer, and shards have no common order of rows: read by "
            "qualified id with get_rows() (packed ids or (shard, row_id) pairs, e.g. from episodes() or "
            "SampleInfo.packed_row_ids), or use learner.shard(i).get(...) on one shard"
        )

    def get_segments(self) -> list[tuple[int, int]]:
        raise NotImplementedError(
            "get_segments() gives logical positions of one buffer, and shards have no common order of rows: "
            "use episodes() (packed ids), or learner.shard(i).get_segments() on one shard"
        )

    def shard(self, index: int) -> LearnerClient:
        """The single-server client of shard `index` (its own logical indices, ids and view).

        Raises:
            ServerUnavailableError: that shard is down.
        """
        self._check()
        client = self.shards[index].client
        if client is None:
            raise ServerUnavailableError(f"shard {index} ({self.endpoints[index]}) is unavailable")
        return client  # type: ignore[no-any-return]

    def sample(self, batch_size: int, seed: int | None = None, *, with_info: bool = False) -> Any:
        """`batch_size` rows drawn uniformly with replacement from all rows of all live shards:
        each batch position picks a shard with probability (its rows) / (all rows), as last seen,
        and every shard draws its share in one request, all at once. `SampleInfo.probabilities` is
        the chance of each row in that draw; `shard_ids` says where each came from."""
        size = _positive(batch_size, "batch_size")
        return self._draw(size, seed, with_info, lambda c, n, s: c.sample(n, s, with_info=True), "rows")

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False) -> Any:
        """`batch_size` windows of `length` steps, each within one episode of one shard; shards are
        picked in proportion to their rows, as for `sample`. A shard holding no episode that long is
        left out of the draw."""
        size, steps = _positive(batch_size, "batch_size"), _positive(length, "length")
        return self._draw(size, seed, with_info, lambda c, n, s: c.sample_sequences(n, steps, s, with_info=True),
                          f"windows of {steps} steps")

    def _draw(self, size: int, seed: int | None, with_info: bool, call: Callable[[Any, int, int | None], Any],
              what: str) -> Any:
        rng = self._rng if seed is None else np.random.default_rng(seed)
        empty: set[int] = set()  # shards that had nothing to draw in this call
        with self._lock:
            for _ in range(2 * len(self.shards) + 2):  # each retry leaves a shard out, or learns its length
                live = [i for i in self._live() if i not in empty]
                unknown = [i for i in live if self._lengths[i] < 0]
                if unknown:
                    for index, n in self._fan_out({i: len for i in unknown}).items():
                        self._lengths[index] = n
                    continue
                lengths = self._lengths[live].astype(np.float64)
                if not live or lengths.sum() == 0:
                    self.__len__()  # the lengths may be stale: look once more
                    live = [i for i in live if self.shards[i].client is not None and self._lengths[i] > 0]
                    if not live:
                        raise NotEnoughDataError(f"cannot sample {what}: no live shard has any "
                                                 f"({len(self.shards)} shards, {len(empty)} without enough)")
                    lengths = self._lengths[live].astype(np.float64)
                weights = lengths / lengths.sum()
                assign = rng.choice(len(live), size=size, p=weights)
                counts = np.bincount(assign, minlength=len(live))
                calls: dict[int, Callable[[LearnerClient], Any]] = {}
                for k, index in enumerate(live):
                    part_seed = None if seed is None else int(rng.integers(2**62))
                    calls[index] = _drawer(call, int(counts[k]), part_seed) if counts[k] else len
                results = self._fan_out(calls)
                for index, result in results.items():
                    if isinstance(result, int):
                        self._lengths[index] = result
                    elif result is _EMPTY:
                        empty.add(index)
                        self._lengths[index] = -1
                    else:
                        view = self.shards[index].client.view if self.shards[index].client is not None else None
                        if view is not None:
                            self._lengths[index] = view.length
                if any(counts[k] and (i not in results or results[i] is _EMPTY) for k, i in enumerate(live)):
                    continue  # a shard went down or had nothing: draw again among the others
                return self._merge(live, assign, weights, results, with_info)
        raise NotEnoughDataError(f"cannot sample {what}: the shards kept going down or emptying during the call")

    def _merge(self, live: list[int], assign: np.ndarray, weights: np.ndarray, results: Mapping[int, Any],
               with_info: bool) -> Any:
        masks = {index: assign == k for k, index in enumerate(live) if not isinstance(results[index], int)}
        parts = {index: self._flat(results[index][0]) for index in masks}
        batch = self._unflat(_scatter(parts, masks, assign.shape[0]))
        if not with_info:
            return batch
        size = assign.shape[0]
        row_ids = np.empty(size, np.uint64)
        episode_ids = np.empty(size, np.uint64)
        probabilities = np.empty(size, np.float64)
        shard_ids = np.empty(size, np.int64)
        for k, index in enumerate(live):
            if index not in masks:
                continue
            info: SampleInfo = results[index][1]
            mask = masks[index]
            row_ids[mask], episode_ids[mask] = info.row_ids, info.episode_ids
            probabilities[mask] = info.probabilities * weights[k]
            shard_ids[mask] = index
        return batch, SampleInfo(row_ids, episode_ids, probabilities, shard_ids)

    def close(self) -> None:
        """Close every shard's client. Safe to call twice."""
        with self._lock:
            super().close()
            self._pool.shutdown(wait=False, cancel_futures=True)


_EMPTY = object()


def _run_inline(call: Callable[[Any], Any], client: Any) -> cf.Future[Any]:
    future: cf.Future[Any] = cf.Future()
    try:
        future.set_result(call(client))
    except BaseException as exc:  # noqa: B036 (handed back through the future, as a pool would)
        future.set_exception(exc)
    return future


def _drawer(call: Callable[[Any, int, int | None], Any], count: int, seed: int | None) -> Callable[[Any], Any]:
    def draw(client: Any) -> Any:
        try:
            return call(client, count, seed)
        except NotEnoughDataError:
            return _EMPTY

    return draw


def _reader(index: int, ids: np.ndarray) -> Callable[[Any], Any]:
    def read(client: Any) -> Any:
        try:
            return client.get_rows(ids)
        except EvictedError as exc:
            raise EvictedError(f"shard {index}: {exc}") from exc

    return read


def _scatter(parts: Mapping[int, Mapping[str, Any]], masks: Mapping[int, np.ndarray], size: int) -> dict[str, Any]:
    """One flat batch of `size` rows from each shard's part, placed where its mask is true."""
    first = next(iter(parts.values()))
    out: dict[str, Any] = {}
    for path, arr in first.items():
        arr = np.asarray(arr)
        if len(parts) == 1:
            out[path] = arr
            continue
        # Text decodes to str arrays whose width is each part's longest: take the widest.
        dtype = np.result_type(*(np.asarray(part[path]).dtype for part in parts.values()))
        merged = np.empty((size, *arr.shape[1:]), dtype)
        for index, part in parts.items():
            merged[masks[index]] = part[path]
        out[path] = merged
    return out

