"""The asyncio actor behind the blocking actor's calls, so one test body serves both drivers:
`AsyncActorFront` runs each coroutine of an `AsyncActorClient` on a loop of its own, and the
`actor_of` fixture (parametrized over "blocking" and "asyncio") makes the actor of its run."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from h5replay.client import ActorClient
from h5replay.client.aio import AsyncActorClient, AsyncPendingCommit

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


class AsyncActorFront(_OnLoop):
    """AsyncActorClient behind the blocking client's calls, on a loop of its own."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:1", timeout: float = 10.0, **kwargs: Any) -> None:
        loop = asyncio.new_event_loop()
        super().__init__(AsyncActorClient(endpoint, timeout, **kwargs), loop)
        try:
            self._run(self._target.connect())
        except BaseException:
            loop.close()
            raise

    def segment(self) -> _OnLoop:
        return _OnLoop(self._target.segment(), self._loop)

    def close(self) -> None:
        if not self._loop.is_closed():
            try:
                self._run(self._target.aclose())
            finally:
                self._loop.close()


@pytest.fixture(params=["blocking", "asyncio"])
def actor_of(request: Any) -> Iterator[Callable[..., Any]]:
    """`actor_of(endpoint, timeout=..., **kwargs)`: an actor of the driver this run is for."""
    made: list[Any] = []

    def make(endpoint: str = "tcp://127.0.0.1:1", timeout: float = 10.0, **kwargs: Any) -> Any:
        client = (ActorClient if request.param == "blocking" else AsyncActorFront)(endpoint, timeout, **kwargs)
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
