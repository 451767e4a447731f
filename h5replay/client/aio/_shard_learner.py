"""AsyncShardedLearner: the learner over several servers on asyncio.

The same routing plans as the blocking learner over shards (h5replay.client._shards.learner:
the split of a batch in proportion to the shards' rows, the merge in the order of the draw,
consuming draws that never drop a row, down shards skipped and probed): each `Fan` runs as one
task per shard's `AsyncLearnerClient`, all at once, and a down shard's probe is a task too. One
call of the router runs at a time (an asyncio lock, as the blocking router's thread lock), and
each of its calls reaches every shard at once.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar

from h5replay.client._core.ops import Now, Sleep
from h5replay.client._shards._router import Fan, Probe, RoutePlan, _Router
from h5replay.client._shards.learner import LearnerRouting

__all__ = ["AsyncRouting", "AsyncShardedLearner"]

T = TypeVar("T")
_C = TypeVar("_C")


class AsyncRouting(_Router[_C]):
    """What both asyncio routers add to the routing of their shards: hellos as tasks (the first
    ones all at once), shards' clients closed without blocking the loop, the router's own calls
    one at a time (`_serial`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._calls: asyncio.Lock | None = None  # the router's calls, one at a time
        self._connecting: asyncio.Lock | None = None
        self._hellos_done = False

    async def _hello(self, endpoint: str) -> Any:
        """A connected client of `endpoint`; closed again when its hello fails or is cancelled."""
        client: Any = self._make(endpoint)
        try:
            return await client.connect()
        except BaseException:
            await client.aclose()
            raise

    async def _connect(self, connected: Callable[[], None]) -> None:
        """Say hello to every shard at once (once); `connected` then reads what they share."""
        if self._hellos_done:
            return
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._hellos_done:
                return
            outcomes = await asyncio.gather(*(self._hello(s.endpoint) for s in self.shards), return_exceptions=True)
            self._admit_initial(outcomes)
            connected()
            self._hellos_done = True

    def _start_probe(self, endpoint: str) -> Probe:
        return asyncio.get_running_loop().create_task(self._hello(endpoint), name="h5replay-probe")

    def _close_client(self, client: Any) -> None:
        """Drop a shard's client now (its sockets closed, its waiters told): it is down, or refused."""
        client._drop()

    def _serial(self) -> asyncio.Lock:
        if self._calls is None:
            self._calls = asyncio.Lock()
        return self._calls

    async def _aclose_shards(self) -> None:
        """Close every shard's client, waiting for each (its draws of cancelled calls end first),
        and stop the probes still running."""
        probes = [s.probe for s in self.shards if s.probe is not None]
        for probe in probes:
            probe.cancel()  # type: ignore[attr-defined]  # this router's probes are asyncio tasks
        clients = [s.client for s in self.shards if s.client is not None]
        await asyncio.gather(*(client.aclose() for client in clients), *probes, return_exceptions=True)


async def fan_out(shards: Sequence[Any], calls: Mapping[int, Callable[[Any], Any]]) -> dict[int, Any]:
    """{shard: result or the exception it raised} of one call per shard's client, each awaited
    in a task of its own, all at once."""
    async def one(call: Callable[[Any], Any], client: Any) -> Any:
        result = call(client)
        return await result if inspect.isawaitable(result) else result

    indices = list(calls)
    outcomes = await asyncio.gather(*(one(calls[i], shards[i].client) for i in indices), return_exceptions=True)
    return dict(zip(indices, outcomes))


class AsyncShardedLearner(AsyncRouting[Any], LearnerRouting[Any]):
    """The routing of `AsyncLearnerClient(endpoints=[...])`: `await connect()` says hello to every
    shard at once, then every verb is a routing plan run here.

    Raises (at connect):
        ConfigError: the shards hold different spaces, or two endpoints reach the same file.
        ServerUnavailableError: no shard answered within the timeout.
    """

    def _size(self, client: Any) -> Any:
        return client.size()

    async def connect(self) -> None:
        self._check()
        await self._connect(self._connected)

    async def run(self, plan: RoutePlan[T]) -> T:
        """The plan's result, each Fan's calls awaited at once; a cancellation is thrown into the
        plan (a consuming draw keeps what it drew)."""
        await self.connect()
        async with self._serial():
            outcomes: dict[int, Any] | None = None
            error: BaseException | None = None
            while True:
                try:
                    op = plan.send(outcomes) if error is None else plan.throw(error)  # type: ignore[arg-type]
                except StopIteration as stop:
                    return stop.value  # type: ignore[no-any-return]
                outcomes, error = None, None
                try:
                    outcomes = self._noted(await fan_out(self.shards, op.calls))
                except BaseException as exc:  # noqa: B036 (cancellation too: the plan keeps what it drew)
                    error = exc

    async def poll(self, plan: Generator[Any, Any, T]) -> T:
        """The result of a plan that waits between routing calls (`wait_for_size`: it yields Now,
        Sleep and a routing plan's Fans). Each Fan holds the router alone; its sleeps do not."""
        await self.connect()
        value: Any = None
        while True:
            try:
                op = plan.send(value)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            value = None
            if isinstance(op, Fan):
                async with self._serial():
                    value = self._noted(await fan_out(self.shards, op.calls))
            elif isinstance(op, Sleep):
                await asyncio.sleep(op.seconds)
            elif isinstance(op, Now):
                value = asyncio.get_running_loop().time()
            else:
                raise TypeError(f"a plan yielded {op!r}, which this router does not run")

    async def aclose(self) -> None:
        """Close every shard's client (rows still kept are dropped, with a warning). Safe twice."""
        if self.closed:
            return
        async with self._serial():
            try:
                await self._aclose_shards()
            finally:
                self.close()
