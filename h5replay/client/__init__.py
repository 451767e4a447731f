"""Clients of an h5replay server: actors write episodes, learners read and sample."""

from __future__ import annotations

from h5replay.client.actor import ActorClient, ActorSegment
from h5replay.client.learner import LearnerClient, View
from h5replay.records import Episode, Receipt, SampleInfo

__all__ = ["ActorClient", "ActorSegment", "Episode", "LearnerClient", "Receipt", "SampleInfo", "View"]
