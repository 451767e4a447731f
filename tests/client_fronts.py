"""The asyncio clients behind the blocking clients' calls, so one test body serves both drivers:
`AsyncActorFront` / `AsyncLearnerFront` run each coroutine of an `AsyncActorClient` /
`AsyncLearnerClient` on a loop of their own, and the `actor_of` / `learner_of` fixtures
(parametrized over "blocking" and "asyncio") make the client of their run. With `endpoints=`
they are the fronts over shards of either driver."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from h5replay.client import ActorClient, LearnerClient
from h5replay.client.aio import AsyncActorClient, AsyncLearnerClient, AsyncPendingCommit

CALL_TIMEOUT = 60.0  # seconds any one coroutine of AsyncActorFront may take


class _OnLoop:
    """An asyncio object behind blocking calls: each coroutine it returns is run on `loop`."""

    def __init__(self, target: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._target, self._loop = target, loop

    def _run(self, value: Any) -> Any:
        if asyncio.iscoroutine(value):
            value = self._loop.run_until_complete(asyncio.wait_for(value, CALL_TIMEOUT))
        if isinstance(value, list):
            return [self._wrapped(v) for v in value]
        return self._wrapped(value)

    def _wrapped(self, value: Any) -> Any:
        return _OnLoop(value, self._loop) if isinstance(value, AsyncPendingCommit) else value

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if not callable(attribute):
            return attribute
        return lambda *args, **kwargs: self._run(attribute(*args, **kwargs))

    def __len__(self) -> int:
        return len(self._target)

    def __enter__(self) -> _OnLoop:
        self._run(self._target.__aenter__())
        return self

    def __exit__(self, *exc: Any) -> None:
        self._run(self._target.__aexit__(*exc))


class _Front(_OnLoop):
    """An asyncio client behind the blocking client's calls, on a loop of its own, connected."""

    def __init__(self, client: Any) -> None:
        loop = asyncio.new_event_loop()
        super().__init__(client, loop)
        try:
            self._run(self._target.connect())
        except BaseException:
            loop.close()
            raise

    def close(self) -> None:
        if not self._loop.is_closed():
            try:
                self._run(self._target.aclose())
            finally:
                self._loop.close()


class AsyncActorFront(_Front):
    """AsyncActorClient behind the blocking client's calls."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:1", timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(AsyncActorClient(endpoint, timeout, **kwargs))

    def segment(self) -> _OnLoop:
        return _OnLoop(self._target.segment(), self._loop)


class AsyncLearnerFront(_Front):
    """AsyncLearnerClient behind the blocking client's calls (`len` is `size()`, `batches` an iterator)."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:1", timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(AsyncLearnerClient(endpoint, timeout, **kwargs))

    def __len__(self) -> int:
        return int(self._run(self._target.size()))

    def batches(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        return self._batches(self._target.batches(*args, **kwargs))  # its arguments checked now

    def _batches(self, stream: Any) -> Iterator[Any]:
        try:
            while True:
                yield self._run(stream.__anext__())
        finally:
            self._run(stream.aclose())


def _clients_of(blocking: type, front: type, driver: str) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(endpoint: str = "tcp://127.0.0.1:1", timeout: float = 10.0, **kwargs: Any) -> Any:
        client = (blocking if driver == "blocking" else front)(endpoint, timeout, **kwargs)
        made.append(client)
        return client

    try:
        yield make
    finally:
        for client in made:
            try:
                client.close()
            except Exception:
                pass


@pytest.fixture(params=["blocking", "asyncio"])
def actor_of(request: Any) -> Iterator[Callable[..., Any]]:
    """`actor_of(endpoint, timeout=..., **kwargs)`: an actor of the driver this run is for."""
    yield from _clients_of(ActorClient, AsyncActorFront, request.param)


@pytest.fixture(params=["blocking", "asyncio"])
def learner_of(request: Any) -> Iterator[Callable[..., Any]]:
    """`learner_of(endpoint, timeout=..., **kwargs)`: a learner of the driver this run is for."""
    yield from _clients_of(LearnerClient, AsyncLearnerFront, request.param)


@dataclasses.dataclass(frozen=True)
class Fronts:
    """`actor(...)` and `learner(...)`: clients of one driver (the `fronts` fixture's run)."""

    driver: str
    actor: Callable[..., Any]
    learner: Callable[..., Any]


@pytest.fixture(params=["blocking", "asyncio"])
def fronts(request: Any) -> Iterator[Fronts]:
    """Actors and learners of the driver this run is for (scenarios with both, e.g. over shards)."""
    actors = _clients_of(ActorClient, AsyncActorFront, request.param)
    learners = _clients_of(LearnerClient, AsyncLearnerFront, request.param)
    try:
        yield Fronts(request.param, next(actors), next(learners))
    finally:
        actors.close()
        learners.close()
