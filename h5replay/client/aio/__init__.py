"""Clients of an h5replay server on asyncio: `AsyncActorClient` (one server) and
`AsyncLearnerClient` (one server, or several with `endpoints=`). They run the same plans of the
client core (h5replay.client._core) and of the shard router (h5replay.client._shards) as the
blocking clients, on `zmq.asyncio`."""

from __future__ import annotations

from h5replay.client.aio.actor import AsyncActorClient, AsyncActorSegment, AsyncPendingCommit
from h5replay.client.aio.learner import AsyncLearnerClient

__all__ = ["AsyncActorClient", "AsyncActorSegment", "AsyncLearnerClient", "AsyncPendingCommit"]
