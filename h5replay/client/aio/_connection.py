"""One DEALER socket to a server on asyncio (`zmq.asyncio`): one future per request id.

`send` encodes a request and sends it (giving up after the client's timeout when no server takes
it); one reader task per connection receives every reply and completes the future of its request
id; `wait` waits for that future within a timeout and raises ServerUnavailableError, never
asyncio.TimeoutError. Replies nobody waits for (late answers, liveness probes with id 0) are
dropped. The socket is set up as the blocking client's is (h5replay.client._connection.dealer).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from typing import Any

import zmq
import zmq.asyncio

from h5replay import protocol as P
from h5replay.client._connection import dealer, no_answer
from h5replay.config import ClientConfig
from h5replay.errors import ClosedError, ProtocolError, ServerUnavailableError

__all__ = ["AsyncConnection"]

log = logging.getLogger("h5replay.client")


class AsyncConnection:
    """A request/reply channel to one endpoint, used by the coroutines of one event loop."""

    def __init__(self, endpoint: str, config: ClientConfig, *, curve: dict[str, bytes] | None = None) -> None:
        self.endpoint = endpoint
        self.config = config
        self.limits: P.Limits | None = None
        self._pid = os.getpid()
        self._ids = itertools.count(1)
        self._futures: dict[int, asyncio.Future[P.Reply]] = {}
        self._with_keys = curve is not None
        self._closed = False
        self._reader: asyncio.Task[None] | None = None
        self._sock: Any = dealer(zmq.asyncio.Context.instance(), endpoint, config, curve)

    @property
    def closed(self) -> bool:
        return self._closed

    def _check(self) -> None:
        if self._closed:
            raise ClosedError(f"this connection to {self.endpoint} was closed")
        if os.getpid() != self._pid:
            raise ClosedError("a client cannot be used across fork; create it in the child process")

    async def send(self, request_factory: Any, timeout: float | None = None) -> int:
        """Send `request_factory(request_id)`; returns the id. Waits at most `timeout` (the
        client's by default) for room in the socket's queue or a connected server, then raises
        ServerUnavailableError."""
        self._check()
        timeout = self.config.timeout if timeout is None else timeout
        request_id = next(self._ids)
        frames = P.encode(request_factory(request_id), self.limits)
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_replies(), name="h5replay-replies")
        # The future exists before the request leaves: its reply cannot come before it.
        self._futures[request_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send(frames, timeout)
        except BaseException:
            self._futures.pop(request_id, None)
            raise
        return request_id

    async def _send(self, frames: list[Any], timeout: float) -> None:
        """Send at once when the socket's queue has room (the usual case: no poll), else wait for
        room within `timeout`. Several coroutines may see room for one message: who finds none
        waits again."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await self._sock.send_multipart(frames, flags=zmq.DONTWAIT, copy=False)
                return
            except zmq.Again:
                pass
            left = deadline - loop.time()
            if left <= 0 or not await self._sock.poll(max(1, int(left * 1000)), zmq.POLLOUT):
                raise ServerUnavailableError(no_answer(self.endpoint, timeout, self._with_keys))

    async def wait(self, request_id: int, timeout: float | None = None) -> P.Reply:
        """The reply to `request_id`, a refusal (ErrorReply) too; ServerUnavailableError when none
        comes within the timeout (the client's by default). A cancelled wait gives the request up
        (its reply, when it comes, is dropped)."""
        self._check()
        timeout = self.config.timeout if timeout is None else timeout
        future = self._futures.get(request_id)
        if future is None:
            raise ProtocolError(f"request {request_id} is not waiting for a reply on this connection")
        if not future.done():
            # A timer of its own rather than asyncio.wait_for: no task or shield per reply. A
            # cancelled caller cancels the future itself: the late reply is then dropped.
            timer = asyncio.get_running_loop().call_later(timeout, _expire, future)
            try:
                await future
            except _Expired:
                self._futures.pop(request_id, None)
                raise ServerUnavailableError(no_answer(self.endpoint, timeout, self._with_keys)) from None
            finally:
                timer.cancel()
        self._futures.pop(request_id, None)
        return future.result()

    def forget(self, request_id: int) -> None:
        """Drop the reply of a request the caller gave up on (when it comes, it is not kept)."""
        future = self._futures.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def _read_replies(self) -> None:
        """Every reply that arrives completes its request's future (the one reader of the socket)."""
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                try:
                    reply = P.decode(frames, self.limits or P.DEFAULT_LIMITS, expect=P.Reply)
                except ProtocolError as exc:  # a broken reply: its waiter (when it names one) raises
                    found = self._futures.get(P.peek_request_id(frames) or 0)
                    if found is not None and not found.done():
                        found.set_exception(exc)
                    else:
                        log.warning("dropped a reply from %s that cannot be read: %s", self.endpoint, exc)
                    continue
                future = self._futures.get(reply.request_id) if reply.request_id is not None else None
                if future is not None and not future.done():
                    future.set_result(reply)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:  # the socket was closed under it: every waiter learns why
            self._fail_all(ClosedError(f"this connection to {self.endpoint} was closed ({exc})"))

    def _fail_all(self, error: BaseException) -> None:
        for future in self._futures.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a future nobody waits for any more logs nothing
        self._futures.clear()

    def close(self) -> None:
        """Close the socket; waiters raise ClosedError. Safe twice."""
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._fail_all(ClosedError(f"this connection to {self.endpoint} was closed"))
        if os.getpid() == self._pid:
            self._sock.close(0)

    async def aclose(self) -> None:
        """`close`, and wait for the reader task to end."""
        reader = self._reader
        self.close()
        if reader is not None:
            await asyncio.wait([reader])  # never raises (the reader's CancelledError stays in it)


class _Expired(Exception):
    """A reply did not come within its timeout (set on its future by the timer)."""


def _expire(future: asyncio.Future[P.Reply]) -> None:
    if not future.done():
        future.set_exception(_Expired())
