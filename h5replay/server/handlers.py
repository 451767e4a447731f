"""What the server does for each request: one method per kind, (request, session) -> reply.

No sockets here: `writer.py` receives and sends; this module validates against the space and the
limits, drives the ReplayBuffer and keeps per-client sessions (open segments, role, last seen).
Reader processes use `read_reply` alone, over their own read-only SWMR view of the file.
Every method either returns a reply or raises; the caller turns exceptions into error replies.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from h5replay import __version__
from h5replay import protocol as P
from h5replay.errors import LimitExceededError, ProtocolError, ReadOnlyError, SegmentStateError, StorageError
from h5replay.storage.replay_buffer import ReplayBuffer
from h5replay.storage.segment import SegmentWriter

__all__ = ["Session", "Service", "read_reply", "Stats"]

log = logging.getLogger("h5replay.server")


@dataclass
class Session:
    """One connected client, known by its ZeroMQ routing id."""

    identity: bytes
    role: str = "actor"
    granted_role: str | None = None  # set by authentication; a client cannot claim more
    name: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    segments: dict[int, SegmentWriter] = field(default_factory=dict)
    next_segment_id: int = 1


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
    started: float = field(default_factory=time.monotonic)


def _arrays_reply_rows(arrays: dict[str, np.ndarray]) -> int:
    return int(next(iter(arrays.values())).shape[0]) if arrays else 0


def _check_reply_rows(buffer: ReplayBuffer, rows: int, limits: P.Limits) -> None:
    """Refuse, before any work, a read whose reply could not travel within the message limit."""
    row_bytes = sum(leaf.row_bytes for _, leaf in buffer.storage.leaves)
    if rows * row_bytes + P.ROWS_MESSAGE_OVERHEAD > limits.max_message_bytes:
        raise LimitExceededError(
            f"a reply of {rows} rows would be {rows * row_bytes} bytes, over the limit max_message_bytes="
            f"{limits.max_message_bytes}; ask for fewer rows per request"
        )


def read_reply(buffer: ReplayBuffer, request: P.Request, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    """Answer a read request (get, sample, sample_sequences, segments) from `buffer`.

    Raises:
        IndexError, NotEnoughDataError, ConfigError: the request cannot be served as asked.
        LimitExceededError: the reply would exceed the message size limit.
        ProtocolError: `request` is not a read request.
    """
    if isinstance(request, P.Get):
        _check_reply_rows(buffer, len(request.indices), limits)
        arrays = buffer.get_stored(request.indices)
        return P.GetReply(request.request_id, len(request.indices), arrays)
    if isinstance(request, P.Sample):
        _check_reply_rows(buffer, request.batch_size, limits)
        gen = rng if request.seed is None else np.random.default_rng(request.seed)
        indices, arrays = buffer.sample_with_indices(request.batch_size, gen, decode=False)
        return P.SampleReply(request.request_id, indices, arrays)
    if isinstance(request, P.SampleSequences):
        _check_reply_rows(buffer, request.batch_size * request.length, limits)
        gen = rng if request.seed is None else np.random.default_rng(request.seed)
        starts, arrays = buffer.sample_sequences_with_starts(request.batch_size, request.length, gen, decode=False)
        return P.SampleSequencesReply(request.request_id, starts, arrays)
    if isinstance(request, P.Segments):
        segments = np.array(buffer.get_segments(), dtype=np.int64).reshape(-1, 2)
        return P.SegmentsReply(request.request_id, segments)
    raise ProtocolError(f"{request.KIND.value} is not a read request")


READ_KINDS = (P.Get, P.Sample, P.SampleSequences, P.Segments)
WRITE_KINDS = (P.OpenSegment, P.Append, P.Commit, P.Abort, P.PushEpisode)


class Service:
    """The writer's request handling over one writable ReplayBuffer. Single-threaded by design."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        limits: P.Limits,
        read_endpoint: str,
        *,
        fsync: bool = False,
        extra_stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.buffer = buffer
        self.limits = limits
        self.read_endpoint = read_endpoint
        self.fsync = fsync
        self.sessions: dict[bytes, Session] = {}
        self.stats = Stats()
        # Set when a write to the file failed (a full disk, an I/O error): HDF5's state can no
        # longer be trusted for writing, so the service refuses writes and serves reads until restarted.
        self.write_failure: str | None = None
        self.unpublished = 0  # commits placed but not yet published: their replies must wait
        self._extra_stats = extra_stats
        self._rng = np.random.default_rng()
        self._handlers: dict[type[P.Request], Callable[[Any, Session], P.Reply]] = {
            P.Hello: self.hello,
            P.OpenSegment: self.open_segment,
            P.Append: self.append,
            P.Commit: self.commit,
            P.Abort: self.abort,
            P.PushEpisode: self.push_episode,
            P.Info: self.info,
            P.Heartbeat: self.heartbeat,
        }

    # ------------------------------------------------------------------ sessions

    def session(self, identity: bytes) -> Session:
        """The session of `identity`, created on its first message (limited to max_clients)."""
        session = self.sessions.get(identity)
        if session is None:
            if len(self.sessions) >= self.limits.max_clients:
                raise LimitExceededError(
                    f"the server already has {len(self.sessions)} clients, the limit max_clients="
                    f"{self.limits.max_clients}; close idle clients or raise the limit"
                )
            session = self.sessions[identity] = Session(identity)
        session.last_seen = time.monotonic()
        return session

    def drop_session(self, identity: bytes) -> int:
        """Forget a client and abort its open segments; returns how many were aborted."""
        session = self.sessions.pop(identity, None)
        if session is None:
            return 0
        return self._abort_all_of(session)

    def _abort_all_of(self, session: Session) -> int:
        count = 0
        for writer in session.segments.values():
            writer.abort()
            count += 1
        session.segments.clear()
        self.stats.aborts += count
        return count

    def expire(self, timeout: float) -> list[bytes]:
        """Abort the segments of sessions silent for `timeout` seconds; returns their identities."""
        now = time.monotonic()
        expired = [s.identity for s in self.sessions.values() if now - s.last_seen > timeout]
        for identity in expired:
            self.drop_session(identity)
        return expired

    def abort_everything(self) -> int:
        """Abort every open segment (shutdown)."""
        return sum(self._abort_all_of(s) for s in self.sessions.values())

    @property
    def open_segments(self) -> int:
        return sum(len(s.segments) for s in self.sessions.values())

    # ------------------------------------------------------------------ dispatch

    def handle(self, identity: bytes, request: P.Request, granted_role: str | None = None) -> P.Reply:
        """The reply to one decoded request. Raises on refusal (the caller makes an error reply).

        `granted_role` is what authentication proved ('actor' or 'learner'); without
        authentication a client's role is what its hello claims.
        """
        self.stats.requests += 1
        session = self.session(identity)
        if granted_role is not None and session.granted_role is None:
            session.granted_role = session.role = granted_role
        if isinstance(request, READ_KINDS):
            reply = read_reply(self.buffer, request, self._rng, self.limits)
            arrays = getattr(reply, "arrays", None)
            if arrays:
                self.stats.rows_out += _arrays_reply_rows(dict(arrays))
            return reply
        if isinstance(request, WRITE_KINDS) and session.role != "actor":
            raise ReadOnlyError(f"a {session.role} may not {request.KIND.value.replace('_', ' ')}; connect as an actor")
        handler = self._handlers.get(type(request))
        if handler is None:
            raise ProtocolError(f"the writer does not serve {request.KIND.value} requests")
        if not isinstance(request, WRITE_KINDS):
            return handler(request, session)
        if self.write_failure is not None:
            raise StorageError(
                f"this server stopped writing after a failed write ({self.write_failure}); it serves reads "
                "until it is restarted, which recovers the file at its last commit"
            )
        try:
            return handler(request, session)
        except StorageError as exc:
            self.write_failure = str(exc)
            log.error("a write to the file failed: %s; refusing writes from now on, serving reads", exc)
            raise

    # ------------------------------------------------------------------ handlers

    def hello(self, request: P.Hello, session: Session) -> P.HelloReply:
        session.name = request.client_name
        # A client may ask for less than it was granted, never more.
        session.role = "learner" if "learner" in (request.role, session.granted_role) else request.role
        buffer = self.buffer
        return P.HelloReply(
            request.request_id, buffer.space.to_json(), buffer.capacity, len(buffer), buffer.num_episodes,
            __version__, P.PROTOCOL_VERSION, self.limits, self.read_endpoint,
        )

    def _writer(self, session: Session, segment_id: int) -> SegmentWriter:
        writer = session.segments.get(segment_id)
        if writer is None:
            raise SegmentStateError(
                f"no open segment {segment_id} for this client (never opened, already committed or aborted, "
                "or aborted because the client went silent)"
            )
        return writer

    def open_segment(self, request: P.OpenSegment, session: Session) -> P.OpenSegmentReply:
        if len(session.segments) >= self.limits.max_open_segments_per_client:
            raise LimitExceededError(
                f"this client already has {len(session.segments)} open segments, the limit "
                f"max_open_segments_per_client={self.limits.max_open_segments_per_client}; commit or abort some"
            )
        segment_id = session.next_segment_id
        session.next_segment_id += 1
        session.segments[segment_id] = self.buffer.open_segment_writer()
        return P.OpenSegmentReply(request.request_id, segment_id)

    def _add_rows(self, writer: SegmentWriter, num_rows: int, arrays: P.Arrays) -> None:
        if len(writer) + num_rows > self.limits.max_rows_per_segment:
            raise LimitExceededError(
                f"the segment would have {len(writer) + num_rows} rows, over the limit max_rows_per_segment="
                f"{self.limits.max_rows_per_segment}; commit it and start another"
            )
        checked = P.check_rows(self.buffer.space, arrays, num_rows)
        writer.extend_stored(checked, num_rows)
        self.stats.rows_in += num_rows
        self.stats.bytes_in += sum(a.nbytes for a in checked.values())

    def append(self, request: P.Append, session: Session) -> P.AppendReply:
        writer = self._writer(session, request.segment_id)
        try:
            self._add_rows(writer, request.num_rows, request.arrays)
        except BaseException:
            if writer.state != "open":  # the file refused the rows: the segment is gone
                session.segments.pop(request.segment_id, None)
                self.stats.aborts += 1
            raise
        return P.AppendReply(request.request_id, len(writer))

    def _commit(self, writer: SegmentWriter) -> tuple[int, int, int]:
        # Group commit: the episode is placed now and published by `publish()`, once for every
        # commit the writer loop handled in one pass, before any of their replies leaves.
        info = self.buffer.commit_segment(writer, publish=False)
        self.unpublished += 1
        self.stats.commits += 1
        if info is None:
            return len(self.buffer), 0, 0
        return info.start, info.length, info.episode_id

    def commit(self, request: P.Commit, session: Session) -> P.CommitReply:
        writer = self._writer(session, request.segment_id)
        del session.segments[request.segment_id]
        return P.CommitReply(request.request_id, *self._commit(writer))

    def abort(self, request: P.Abort, session: Session) -> P.AbortReply:
        writer = self._writer(session, request.segment_id)
        del session.segments[request.segment_id]
        writer.abort()
        self.stats.aborts += 1
        return P.AbortReply(request.request_id)

    def push_episode(self, request: P.PushEpisode, session: Session) -> P.PushEpisodeReply:
        writer = self.buffer.open_segment_writer()
        try:
            self._add_rows(writer, request.num_rows, request.arrays)
            return P.PushEpisodeReply(request.request_id, *self._commit(writer))
        finally:
            if writer.state == "open":
                writer.abort()

    def publish(self) -> None:
        """Publish the commits placed since the last call (flushed; with fsync, on disk).

        Raises:
            StorageError: the file could not take them; the service stops writing.
        """
        if not self.unpublished:
            return
        try:
            self.buffer.flush(fsync=self.fsync)
        except StorageError as exc:
            self.write_failure = str(exc)
            log.error("publishing commits failed: %s; refusing writes from now on, serving reads", exc)
            raise
        finally:
            self.unpublished = 0

    def info(self, request: P.Info, session: Session) -> P.InfoReply:
        return P.InfoReply(request.request_id, self.snapshot())

    def heartbeat(self, request: P.Heartbeat, session: Session) -> P.HeartbeatReply:
        return P.HeartbeatReply(request.request_id)

    def snapshot(self) -> dict[str, Any]:
        """Scalar figures of the service (the INFO reply, the stats command, metrics)."""
        info = self.buffer.info()
        uptime = time.monotonic() - self.stats.started
        path = self.buffer.storage.filename
        stats: dict[str, Any] = {
            "length": info["length"],
            "capacity": info["capacity"],
            "num_episodes": info["num_episodes"],
            "total_rows": info["total_rows"],
            "total_episodes": info["total_episodes"],
            "open_segments": self.open_segments,
            "clients": len(self.sessions),
            "rows_in": self.stats.rows_in,
            "bytes_in": self.stats.bytes_in,
            "commits": self.stats.commits,
            "aborts": self.stats.aborts,
            "requests": self.stats.requests,
            "errors": self.stats.errors,
            "rows_out": self.stats.rows_out,
            "file_bytes": os.path.getsize(path) if path and os.path.exists(path) else 0,
            "uptime": round(uptime, 3),
            "server_version": __version__,
        }
        if self._extra_stats is not None:
            for key, value in self._extra_stats().items():
                stats[key] = stats.get(key, 0) + value if isinstance(value, int) and key in stats else value
        return stats
