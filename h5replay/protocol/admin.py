"""The messages of a session: hello, info, heartbeat, and cancel (of a learner's waiting samples)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from h5replay.protocol.base import Kind, Reply, Request
from h5replay.protocol.checks import Array, Limits, _check_rows_limit

__all__ = ["Hello", "Info", "Heartbeat", "Cancel", "HelloReply", "InfoReply", "HeartbeatReply", "CancelReply"]


@dataclass(frozen=True, eq=False, repr=False)
class Hello(Request):
    KIND = Kind.HELLO
    client_name: str
    role: str  # one of ROLES


@dataclass(frozen=True, eq=False, repr=False)
class Info(Request):
    KIND = Kind.INFO


@dataclass(frozen=True, eq=False, repr=False)
class Cancel(Request):
    """Drop this client's own samples that still wait for the rate limit (a learner leaving a
    `batches` loop, or giving up on the rest of a split sample): their draws are never made."""

    KIND = Kind.CANCEL
    request_ids: Array

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.request_ids), "request_ids", limits)


@dataclass(frozen=True, eq=False, repr=False)
class Heartbeat(Request):
    KIND = Kind.HEARTBEAT


@dataclass(frozen=True, eq=False, repr=False)
class HelloReply(Reply):
    KIND = Kind.HELLO
    space: dict[str, Any]  # Space.to_json(); rebuild with space_from_json
    capacity: int | None  # None: the store grows without bound
    length: int
    num_episodes: int
    server_version: str
    protocol_version: int
    limits: Limits
    read_endpoint: str  # where learners send their reads (reader processes)
    replay_id: str  # the file's UUID: tells this replay from any other
    instance_id: str  # this server process's UUID: tells a restarted server from the same one
    # {name: scalar}: sampler, writer_samples (learners send samples to the writer), ...
    sampling: dict[str, Any] = field(default_factory=dict)
    # Where the file is, for a learner on the same host to draw from its own view of it:
    # path, device, inode (of the file the server holds) and host (the kernel's boot id). None:
    # the server does not say (an older one, or no boot id to tell hosts apart).
    local_file: dict[str, Any] | None = None


@dataclass(frozen=True, eq=False, repr=False)
class InfoReply(Reply):
    KIND = Kind.INFO
    # Scalars by name: length, capacity, num_episodes, open_segments, clients, rows_in, rows_out,
    # bytes_in, bytes_out, commits, aborts, file_bytes, uptime, rows_in_per_s, rows_out_per_s, ...
    stats: dict[str, int | float | str | bool | None]


@dataclass(frozen=True, eq=False, repr=False)
class HeartbeatReply(Reply):
    KIND = Kind.HEARTBEAT


@dataclass(frozen=True, eq=False, repr=False)
class CancelReply(Reply):
    KIND = Kind.CANCEL
    request_ids: Array  # those that were waiting and are dropped: they get no other reply
