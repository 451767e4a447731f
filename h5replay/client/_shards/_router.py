"""What the sharded actor and learner share: the shards, their space and ids, going down, coming back.

Pure routing state over single-server clients; no sockets of its own (each shard's client owns
its connections). The single-server client class is given by the client that routes (ActorClient,
LearnerClient), so that this package never imports the modules that import it.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ConfigError, ServerUnavailableError
from h5replay.spaces import Space

__all__ = ["MAX_SHARDS", "ActorPlan", "Call", "Fan", "Pause", "RoutePlan", "home_shard", "log"]

log = logging.getLogger("h5replay.client")

MAX_SHARDS = 1 << 16  # a packed id has 16 bits of shard

_C = TypeVar("_C")  # the single-server client of one shard
_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Fan:
    """What a routing plan yields: one call per shard's client, all sent at once. The plan is
    sent {shard: the call's result, or the exception it raised}; a shard that did not answer is
    already marked down. A call returns its result or, on an asyncio client, an awaitable of it:
    the same plan runs on the blocking router (threads) and the asyncio one (one task per shard)."""

    calls: Mapping[int, Callable[[Any], Any]]


#: A routing plan: yields Fan operations, returns the verb's result (h5replay.client._core's way).
RoutePlan = Generator[Fan, dict[int, Any], _T]


@dataclasses.dataclass(frozen=True)
class Call:
    """What an actor's routing plan yields: run `fn()` (a shard client's verb: its result, or on
    asyncio an awaitable of it) and send the plan its result; what it raises is thrown in."""

    fn: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Pause:
    """Wait `seconds` (the router's other calls may run meanwhile)."""

    seconds: float


#: An actor's routing plan: yields Call and Pause, returns the verb's result.
ActorPlan = Generator[Call | Pause, Any, _T]


def home_shard(name: str, num_shards: int) -> int:
    """The shard an actor called `name` writes to while it answers: a 64-bit BLAKE2b digest of the
    name, modulo the number of shards. Stable across processes and machines, unlike the salted
    built-in hash(); and well mixed, unlike crc32, whose low bits are a linear function of the
    name's bits (names that differ in a counter, such as containers' hostnames with one pid, could
    all land on one shard)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"h5replay-shard").digest()
    return int.from_bytes(digest, "little") % num_shards


class _Shard:
    """One endpoint and what this client knows of it."""

    def __init__(self, index: int, endpoint: str) -> None:
        self.index = index
        self.endpoint = endpoint
        self.client: Any = None  # an ActorClient / LearnerClient while it is in use
        self.replay_id: str | None = None  # its file's id, once it answered
        self.retry_at = 0.0  # down until then (monotonic seconds); 0: not known to be down
        self.probe: Probe | None = None  # a background hello while it is down
        self.num_down = 0  # times it was found unavailable


class Probe(Protocol):
    """A hello running in the background: a concurrent.futures.Future or an asyncio.Task."""

    def done(self) -> bool: ...

    def cancelled(self) -> bool: ...

    def result(self) -> Any: ...

    def exception(self) -> BaseException | None: ...

    def add_done_callback(self, fn: Callable[[Any], object], /) -> None: ...


def _outcome(future: Probe) -> Any:
    """The future's result, or the exception it raised (returned, not raised)."""
    try:
        return future.result()
    except BaseException as exc:  # noqa: B036 (handed back to the caller, who re-raises what it does not handle)
        return exc


class _Router(Generic[_C]):
    """What both sharded clients share: the shards, their space and ids, going down, coming back.
    `client_class` makes the single-server client of one shard (from `config`, `secret_key` and
    `server_key`)."""

    role = "client"

    def __init__(
        self, endpoints: Sequence[str], config: ClientConfig, secret_key: Any = None, server_key: Any = None, *,
        client_class: Callable[..., _C],
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
        self._client_class = client_class
        self.shards = [_Shard(i, e) for i, e in enumerate(endpoints)]
        self.space: Space | None = None
        self._keys = (secret_key, server_key)
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._closed = False
        self._probes: cf.ThreadPoolExecutor | None = None  # the blocking router's background hellos

    # ------------------------------------------------------------------ hooks

    def _make(self, endpoint: str) -> _C:
        """A single-server client of `endpoint` (says hello; blocks up to the timeout)."""
        return self._client_class(**self._client_kwargs(endpoint))

    def _start_probe(self, endpoint: str) -> Probe:
        """A hello to `endpoint` in the background: a future of its client. The blocking router's
        runs in a worker thread; the asyncio router's is a task (h5replay.client.aio._shards)."""
        if self._probes is None:
            self._probes = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="h5replay-probe")
        return self._probes.submit(self._make, endpoint)

    def _close_client(self, client: Any) -> None:
        """Close one shard's client now (the asyncio router's drops its sockets without waiting)."""
        client.close()

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
        self._admit_initial(outcomes)

    def _admit_initial(self, outcomes: Sequence[Any]) -> None:
        """Use the clients of the first hellos (one outcome per shard: its client, or what its
        hello raised); closes them all when one is refused. Raises as `_connect_initial`."""
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
                    self._close_client(outcome)
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
            self._close_client(client)
        shard.num_down += 1
        shard.retry_at = time.monotonic() + self.config.shard_retry_interval
        log.warning("shard %d (%s) is unavailable, skipping it and trying it again every %.1f s: %s",
                    shard.index, shard.endpoint, self.config.shard_retry_interval, exc)

    def _noted(self, outcomes: dict[int, Any]) -> dict[int, Any]:
        """`outcomes` of a Fan, every shard that did not answer marked down."""
        for index, outcome in outcomes.items():
            if isinstance(outcome, ServerUnavailableError):
                self._mark_down(self.shards[index], outcome)
        return outcomes

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
                    self._close_client(outcome)
                    shard.retry_at = now + self.config.shard_retry_interval
                    continue
                log.warning("shard %d (%s) answers again", shard.index, shard.endpoint)
                self._adopted(shard)
            elif shard.probe is None and shard.retry_at and now >= shard.retry_at and self._wants_probe(shard):
                shard.probe = self._start_probe(shard.endpoint)

    def close(self) -> None:
        """Close every shard's client; a probe still running closes its own when it ends. Safe twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for shard in self.shards:
                if shard.probe is not None:
                    shard.probe.add_done_callback(self._close_probed)
                    shard.probe = None
                if shard.client is not None and os.getpid() == self._pid:
                    client, shard.client = shard.client, None
                    self._close_client(client)
            if self._probes is not None:
                self._probes.shutdown(wait=False, cancel_futures=True)

    def _close_probed(self, probe: Probe) -> None:
        """A probe that ends after close(): the client it made is closed."""
        if not probe.cancelled() and probe.exception() is None:
            self._close_client(probe.result())

    def _client_kwargs(self, endpoint: str) -> dict[str, Any]:
        return {"config": dataclasses.replace(self.config, endpoint=endpoint),
                "secret_key": self._keys[0], "server_key": self._keys[1]}


# ====================================================================================== actors


