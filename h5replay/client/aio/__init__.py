"""Clients of an h5replay server on asyncio: `AsyncLearnerClient` (one server; shards and an
asyncio actor are not yet here). They run the same plans of the client core
(h5replay.client._core) as the blocking clients, on `zmq.asyncio`."""

from __future__ import annotations

from h5replay.client.aio.learner import AsyncLearnerClient

__all__ = ["AsyncLearnerClient"]
