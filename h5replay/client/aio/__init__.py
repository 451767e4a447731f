"""Clients of an h5replay server on asyncio: `AsyncActorClient` and `AsyncLearnerClient` (one
server each; shards are not yet here). They run the same plans of the client core
(h5replay.client._core) as the blocking clients, on `zmq.asyncio`."""

from __future__ import annotations

from h5replay.client.aio.actor import AsyncActorClient, AsyncActorSegment, AsyncPendingCommit
from h5replay.client.aio.learner import AsyncLearnerClient

__all__ = ["AsyncActorClient", "AsyncActorSegment", "AsyncLearnerClient", "AsyncPendingCommit"]
