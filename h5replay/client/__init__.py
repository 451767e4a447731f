"""Clients of an h5replay server (or of several: `endpoints=[...]`): actors write episodes, learners read and sample.

On asyncio: `h5replay.client.aio.AsyncLearnerClient` (not imported here, so that blocking users never load it).
"""

from __future__ import annotations

from h5replay.client._shards import InDoubt
from h5replay.client.actor import ActorClient, ActorSegment, PendingCommit
from h5replay.client.learner import LearnerClient, View
from h5replay.records import Episode, Receipt, SampleInfo, pack_ids, unpack_ids

__all__ = [
    "ActorClient", "ActorSegment", "Episode", "InDoubt", "LearnerClient", "PendingCommit", "Receipt", "SampleInfo", "View",
    "pack_ids", "unpack_ids",
]
