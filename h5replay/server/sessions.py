"""What the writer keeps of each client (a Session: its role, key, open segments, when last
heard from) and in all (Stats: the counters `info` and the metrics read)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from h5replay.storage.segment import SegmentWriter

__all__ = ["Session", "Stats"]


@dataclass
class Session:
    """One connected client, known by its ZeroMQ routing id (and, under --auth, bound to the key
    of its first message: no other key may use that routing id while the session lasts)."""

    identity: bytes
    claimed_role: str = "actor"  # what its hello asked for; a client may ask for less than granted
    granted_role: str | None = None  # what its key may do now (under --auth), looked up per message
    key: str | None = None
    name: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    segments: dict[int, SegmentWriter] = field(default_factory=dict)

    @property
    def role(self) -> str:
        """'learner' when the key or the hello says so, else 'actor'."""
        return "learner" if "learner" in (self.claimed_role, self.granted_role) else "actor"


@dataclass
class Stats:
    """Counters the writer keeps; `info` and metrics read them."""

    rows_in: int = 0
    bytes_in: int = 0
    commits: int = 0
    aborts: int = 0
    requests: int = 0
    errors: int = 0
    rows_out: int = 0
    rows_sampled: int = 0  # of rows_out, those drawn (sample, sample_sequences, sample_transitions)
    started: float = field(default_factory=time.monotonic)
