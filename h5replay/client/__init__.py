"""Clients of an h5replay server: actors write episodes, learners read and sample."""

from __future__ import annotations

from h5replay.client.actor import ActorClient, ActorSegment, Receipt
from h5replay.client.learner import LearnerClient

__all__ = ["ActorClient", "ActorSegment", "LearnerClient", "Receipt"]
