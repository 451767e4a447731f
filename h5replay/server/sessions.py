"""What the writer keeps of each client (a Session: its role, key, open segments, when last
heard from) and in all (Stats: the counters `info` and the metrics read), and who may open a
new session (`check_admission`: the server's quotas)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from h5replay.errors import LimitExceededError
from h5replay.storage.segment import SegmentWriter

__all__ = ["Session", "Stats", "check_admission"]


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


def check_admission(sessions: Mapping[bytes, Session], key: str | None, granted_role: str | None,
                    max_clients: int, actor_slots: int, max_clients_per_key: int | None) -> None:
    """Whether a new client may open a session beside `sessions`: within `max_clients`, the last
    `actor_slots` of them kept for actor keys, and `max_clients_per_key` sessions per key.

    Raises:
        LimitExceededError: a quota is full (the message names it and what to do).
    """
    if len(sessions) >= max_clients:
        raise LimitExceededError(
            f"the server already has {len(sessions)} clients, the limit max_clients={max_clients}; close idle "
            "clients or raise the limit"
        )
    if granted_role is not None and granted_role != "actor" and len(sessions) >= max_clients - actor_slots:
        raise LimitExceededError(
            f"the server has {len(sessions)} clients; its last {actor_slots} slots of max_clients={max_clients} "
            "are kept for actor keys"
        )
    if key is not None and max_clients_per_key is not None:
        same = sum(1 for other in sessions.values() if other.key == key)
        if same >= max_clients_per_key:
            raise LimitExceededError(
                f"this key already has {same} clients on the server, the limit max_clients_per_key="
                f"{max_clients_per_key} (--max-clients-per-key); close some, or give each host a key"
            )
