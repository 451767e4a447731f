"""Clients of an h5replay server on asyncio: `AsyncActorClient` and `AsyncLearnerClient`, of one
server, or of several ("shards") with `endpoints=`. They run the same plans of the
client core (h5replay.client._core) and of the shard router (h5replay.client._shards) as the
blocking clients, on `zmq.asyncio`."""

from __future__ import annotations

from h5replay.client.aio.actor import AsyncActorClient, AsyncActorSegment, AsyncPendingCommit, AsyncShardedActorClient
from h5replay.client.aio.learner import AsyncLearnerClient, AsyncShardedLearnerClient

__all__ = [
    "AsyncActorClient", "AsyncActorSegment", "AsyncLearnerClient", "AsyncPendingCommit", "AsyncShardedActorClient",
    "AsyncShardedLearnerClient",
]
