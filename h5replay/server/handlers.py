"""What the server does for each request: one method per kind, (request, session) -> reply.

No sockets here: `writer.py` receives and sends; this module validates against the space and the
limits, drives the ReplayBuffer and keeps per-client sessions (sessions.py: open segments, role,
last seen). Reads are answered by `read_reply` (reads.py), which reader processes use alone, over
their own read-only SWMR view of the file; the disk's reserve is disk.py's.
Every method either returns a reply or raises; the caller turns exceptions into error replies.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from h5replay import __version__
from h5replay import protocol as P
from h5replay.errors import (
    AccessDeniedError,
    ConfigError,
    DiskFullError,
    LimitExceededError,
    ProtocolError,
    RateLimitedError,
    ReadOnlyError,
    SegmentStateError,
    StorageError,
)
from h5replay.hosts import describe_file
from h5replay.sampling import describe_tables
from h5replay.server.disk import DiskReserve
from h5replay.server.reads import read_reply, reply_rows
from h5replay.server.sessions import Session, Stats, check_admission
from h5replay.server.waiting import Side, WaitingRoom
from h5replay.storage.replay.buffer import ReplayBuffer
from h5replay.storage.segment import SegmentWriter

__all__ = ["Session", "Service", "read_reply", "reply_rows", "Stats"]

log = logging.getLogger("h5replay.server")

_WAITING_PER_CLIENT = 4  # requests one client may have waiting for the rate limit, on average
_WAITING_BYTES = 256 << 20  # rows of waiting push_episode requests held in memory, at most

#: (identity, request, granted role, key): a request waiting for the rate limit.
Parked = tuple[bytes, P.Request, str | None, str | None]


def _local_file(buffer: ReplayBuffer) -> dict[str, Any] | None:
    """The served file's path, device, inode and host (None when they cannot be told, or the rows
    are in no file)."""
    try:
        storage = buffer.file_storage
        return None if storage.filename is None else describe_file(storage.filename, *storage.file_identity())
    except (StorageError, ConfigError):
        return None


class Service:
    """The writer's request handling over one writable ReplayBuffer. Single-threaded by design."""

    def __init__(
        self,
        buffer: ReplayBuffer,
        limits: P.Limits,
        read_endpoint: str,
        *,
        fsync: bool = False,
        priority_publish_interval: float = 0.0,
        extra_stats: Callable[[], dict[str, Any]] | None = None,
        instance_id: str = "",
        min_free_bytes: int = 0,
        max_clients_per_key: int | None = None,
        actor_slots: int = 0,
        reads_elsewhere: bool = False,
    ) -> None:
        self.buffer = buffer
        # Quotas (under --auth): sessions one key may hold, and slots of max_clients only actor
        # keys may take (so learners can never lock actors out).
        self.max_clients_per_key = max_clients_per_key
        self.actor_slots = actor_slots
        # True while reader processes run: reads sent here are refused, naming where to read.
        self.reads_elsewhere = reads_elsewhere
        #: Under --auth, a key's role now (set by `revoke`): requests that waited are checked again.
        self.role_of: Callable[[str], str | None] | None = None
        # New rows are refused (DiskFullError) while the disk has less than min_free_bytes free;
        # nothing is written then, so no write fails and the server does not go read-only.
        self.disk = DiskReserve(buffer.storage.filename, min_free_bytes)
        self.instance_id = instance_id
        self.limits = limits
        #: What the hello says of the file, for learners on this host to draw from it themselves.
        self.local_file = _local_file(buffer)
        self.read_endpoint = read_endpoint
        self.fsync = fsync
        self.priority_publish_interval = priority_publish_interval
        self._updates_since = 0.0  # when the oldest priority update not yet published was applied
        self.sessions: dict[bytes, Session] = {}
        self.stats = Stats()
        # Set when a write to the file failed (a full disk, an I/O error): HDF5's state can no
        # longer be trusted for writing, so the service refuses writes and serves reads until restarted.
        self.write_failure: str | None = None
        self.unpublished = 0  # commits placed but not yet published: their replies must wait
        self._extra_stats = extra_stats
        self._rng = np.random.default_rng()
        # Segment ids are unique for the life of this process, whoever asks: a client that lost its
        # session (silence, reconnect) can never reach a segment of its new one with an old id. They
        # start at random, so that a request a client queued for the server before a restart (its
        # socket keeps what it could not send) cannot land in a segment of the new server either.
        self._next_segment_id = 1 + int.from_bytes(os.urandom(5), "big")
        self._segment_owner: dict[int, bytes] = {}
        self._handlers: dict[type[P.Request], Callable[[Any, Session], P.Reply]] = {
            P.Hello: self.hello,
            P.OpenSegment: self.open_segment,
            P.Append: self.append,
            P.Commit: self.commit,
            P.Abort: self.abort,
            P.PushEpisode: self.push_episode,
            P.PushEpisodes: self.push_episodes,
            P.UpdatePriorities: self.update_priorities,
            P.Info: self.info,
            P.Heartbeat: self.heartbeat,
            P.Cancel: self.cancel,
        }
        tables = buffer.tables
        #: The tables whose samples change the buffer (a rate limit, or removals): only this
        #: service draws them.
        self._writer_tables = {name for name, t in tables.items() if t.writer_only is not None}
        #: Whether some table's samples are drawn here only.
        self.writer_samples = bool(self._writer_tables)
        self._limited = any(t.rate_limit.active or t.removes for t in tables.values())
        #: Samples and commits the rate limit holds back (see waiting.py).
        self.waiting: WaitingRoom[Parked] = WaitingRoom(
            lambda side, rows, table: buffer.rate_limit_blocker(rows, sampling=side == "sample", table=table),
            max_waiting=limits.max_clients * _WAITING_PER_CLIENT,
        )
        self._waiting_bytes = 0
        # Rows each kind of write inserts, for the rate limit (kinds not here insert none).
        self._inserts: dict[type[P.Request], Callable[[bytes, Any], int]] = {
            P.Commit: self._commit_rows, P.PushEpisode: self._push_rows, P.PushEpisodes: self._pushes_rows,
        }

    # ------------------------------------------------------------------ sessions

    # ------------------------------------------------------------------ the rate limit

    def _gate(self, identity: bytes, request: P.Request) -> tuple[Side, int, str | None] | None:
        """(side, rows, table) of a request the rate limit governs; None for any other."""
        if not self._limited:
            return None
        if request.DRAWS:
            if not self._draws_here(request):
                return None
            return "sample", request.num_drawn, request.table  # type: ignore[attr-defined]
        inserts = self._inserts.get(type(request))
        rows = inserts(identity, request) if inserts is not None else 0
        return ("insert", rows, None) if rows else None

    def _draws_here(self, request: P.Request) -> bool:
        """Whether a draw changes the buffer (its table is rate-limited or removes rows), so
        only this service may serve it.

        Raises:
            ConfigError: the request names no table of this buffer (or none where there are several).
        """
        return self.buffer.table_name(getattr(request, "table", None)) in self._writer_tables

    def _commit_rows(self, identity: bytes, request: P.Commit) -> int:
        session = self.sessions.get(identity)
        writer = session.segments.get(request.segment_id) if session is not None else None
        return len(writer) if writer is not None else 0

    def _push_rows(self, identity: bytes, request: P.PushEpisode) -> int:
        if self._committed(request.idempotency_key, None) is not None:
            return 0  # a retry of a push already applied: answered at once, never held back
        return request.num_rows

    def _pushes_rows(self, identity: bytes, request: P.PushEpisodes) -> int:
        # A retry counts only the episodes not yet applied: those are all it will insert.
        return sum(int(n) for key, n in zip(request.keys, request.lengths) if self._committed(bytes(key), int(n)) is None)

    def submit(self, identity: bytes, request: P.Request, granted_role: str | None = None,
               key: str | None = None) -> P.Reply | None:
        """`handle`, through the rate limit: a sample or commit it holds back waits (None is
        returned; `released` gives its reply later), first come first served, at most the
        request's `timeout`; one that could never go ahead, or may not wait, is refused.

        Raises:
            RateLimitedError: refused by the rate limit (the message says which side is ahead).
        """
        gate = self._gate(identity, request)
        if gate is None:
            return self.handle(identity, request, granted_role, key)
        side, rows, table = gate
        nbytes = sum(a.nbytes for a in request.arrays.values()) if request.CARRIES_ROWS else 0  # type: ignore[attr-defined]
        if nbytes and self._waiting_bytes + nbytes > _WAITING_BYTES and self.waiting.count("insert"):
            raise RateLimitedError(f"the rate limit holds inserts back and {self._waiting_bytes} bytes of episodes "
                                   "already wait in this server's memory; stream long episodes through segments")
        timeout = float(getattr(request, "timeout", 0.0))
        self.session(identity, key, granted_role)  # a client refused a session waits for nothing
        status, why = self.waiting.admit(side, rows, timeout, (identity, request, granted_role, key), table)
        if status == "go":
            return self.handle(identity, request, granted_role, key)
        if status == "refused":
            raise RateLimitedError(f"{why} (the request's timeout: {timeout:g} s)")
        self._waiting_bytes += nbytes
        return None

    def released(self) -> list[tuple[bytes, P.Reply]]:
        """Replies to waiting requests that may go now (served now, oldest first), and refusals of
        those whose timeout ended."""
        out: list[tuple[bytes, P.Reply]] = []
        while (ready := self.waiting.next_ready()) is not None:
            identity, request, role, key = ready.payload
            self._forget_bytes(request)
            try:
                if key is not None and self.role_of is not None:  # the key's role now, not when it came
                    role = self.role_of(key)
                    if role is None:
                        raise AccessDeniedError("this client's key is no longer listed in the server's key directories")
                reply: P.Reply = self.handle(identity, request, role, key)
            except Exception as exc:  # the request's own refusal, as if it had not waited
                self.stats.errors += 1
                reply = P.ErrorReply.from_exception(request.request_id, exc)
            out.append((identity, reply))
        for late in self.waiting.expire():
            identity, request, _, _ = late.payload
            self._forget_bytes(request)
            self.stats.errors += 1
            waited = late.deadline - late.since
            refusal = RateLimitedError(f"{late.reason} (waited the request's whole timeout, {waited:g} s)")
            out.append((identity, P.ErrorReply.from_exception(request.request_id, refusal)))
        return out

    def _forget_bytes(self, request: P.Request) -> None:
        if request.CARRIES_ROWS:
            self._waiting_bytes -= sum(a.nbytes for a in request.arrays.values())  # type: ignore[attr-defined]

    def needs_publish(self, reply: P.Reply) -> bool:
        """Whether a reply may leave only after the publish that carries what it acknowledges:
        commits, priority updates, and samples that changed the buffer (counted, or rows
        removed). So a reply never names a publish the file does not have yet, and what it
        acknowledges survives a crash of the writer."""
        return reply.ACKNOWLEDGES or (self.writer_samples and reply.DRAWN)

    def session(self, identity: bytes, key: str | None = None, granted_role: str | None = None) -> Session:
        """The session of `identity`, created on its first message (within max_clients, the
        per-key quota and the slots kept for actors). Under --auth `key` is the message's key.

        Raises:
            AccessDeniedError: the routing id is bound to another key.
            LimitExceededError: a quota is full.
        """
        session = self.sessions.get(identity)
        if session is not None:
            if session.key != key:
                raise AccessDeniedError(
                    f"routing id {identity.hex()} belongs to a client with another key; a client may not take over "
                    "another's routing id (leave ZMQ_ROUTING_ID unset, or use one of your own)"
                )
        else:
            check_admission(self.sessions, key, granted_role, self.limits.max_clients, self.actor_slots,
                            self.max_clients_per_key)
            session = self.sessions[identity] = Session(identity, key=key)
        session.granted_role = granted_role
        session.last_seen = time.monotonic()
        return session

    def drop_session(self, identity: bytes) -> int:
        """Forget a client: abort its open segments and drop its requests waiting for the rate
        limit (a sample drawn for a client that went away would take queue rows nobody gets);
        returns how many segments were aborted."""
        for gone in self.waiting.drop(lambda parked: parked[0] != identity):
            self._forget_bytes(gone.payload[1])
        session = self.sessions.pop(identity, None)
        if session is None:
            return 0
        return self._abort_all_of(session)

    def _abort_all_of(self, session: Session) -> int:
        count = 0
        for segment_id, writer in session.segments.items():
            writer.abort()
            self._segment_owner.pop(segment_id, None)
            count += 1
        session.segments.clear()
        self.stats.aborts += count
        return count

    def expire(self, timeout: float, idle_timeout: float | None = None) -> list[tuple[bytes, int]]:
        """Drop sessions silent for `timeout` seconds (their open segments are aborted) and, with
        `idle_timeout`, sessions without an open segment silent that long (a client waiting for the
        rate limit is not silent); returns (id, segments aborted) of each."""
        now = time.monotonic()
        waiting = {w.payload[0] for queue in self.waiting.queues.values() for w in queue}
        expired = [s.identity for s in self.sessions.values() if s.identity not in waiting
                   and now - s.last_seen > (timeout if s.segments or idle_timeout is None else min(timeout, idle_timeout))]
        return [(identity, self.drop_session(identity)) for identity in expired]

    def revoke(self, role_of: Callable[[str], str | None]) -> tuple[list[bytes], list[bytes]]:
        """Apply changed keys to live sessions: a key no longer listed loses its sessions (their
        open segments are aborted), a key moved to learners its open segments. Returns (ids of the
        sessions dropped, ids of the sessions demoted). Requests waiting for the rate limit are
        checked again against `role_of` when they are let go (see `released`)."""
        self.role_of = role_of
        dropped, demoted = [], []
        for identity, session in list(self.sessions.items()):
            if session.key is None:
                continue
            role = role_of(session.key)
            if role is None:
                self.drop_session(identity)
                dropped.append(identity)
            elif role != "actor" and session.segments:
                self._abort_all_of(session)
                session.granted_role = role
                demoted.append(identity)
        return dropped, demoted

    def abort_everything(self) -> int:
        """Abort every open segment (shutdown)."""
        return sum(self._abort_all_of(s) for s in self.sessions.values())

    @property
    def open_segments(self) -> int:
        return len(self._segment_owner)

    # ------------------------------------------------------------------ dispatch

    def handle(self, identity: bytes, request: P.Request, granted_role: str | None = None,
               key: str | None = None) -> P.Reply:
        """The reply to one decoded request. Raises on refusal (the caller makes an error reply).

        `granted_role` is what authentication says `key` (the message's) may do now ('actor' or
        'learner'), looked up for this very message; without authentication a client's role is
        what its hello claims.
        """
        self.stats.requests += 1
        session = self.session(identity, key, granted_role)
        if request.READS:
            if request.DRAWS and self._draws_here(request):  # they change the buffer: drawn here
                if self.write_failure is not None:
                    raise StorageError(f"this server stopped writing after a failed write ({self.write_failure}); "
                                       "samples change the buffer here (a rate limit, or removals), so none is served")
                self.unpublished += 1  # the counters (and removals) are published before the reply leaves
            elif self.reads_elsewhere:
                raise ProtocolError(
                    f"{request.KIND.value} is a read: this endpoint takes writes, hello, info, heartbeats and priority updates; reads go "
                    f"to the read endpoint, {self.read_endpoint} (its hello names it; LearnerClient reads there)"
                )
            reply = read_reply(self.buffer, request, self._rng, self.limits)
            rows = reply_rows(reply)
            self.stats.rows_out += rows
            self.stats.rows_sampled += rows if reply.DRAWN else 0
            return reply
        if request.WRITES and session.role != "actor":
            raise ReadOnlyError(f"a {session.role} may not {request.KIND.value.replace('_', ' ')}; connect as an actor")
        handler = self._handlers.get(type(request))
        if handler is None:
            raise ProtocolError(f"the writer does not serve {request.KIND.value} requests")
        if not request.WRITES:
            return handler(request, session)
        if self.write_failure is not None:
            raise StorageError(
                f"this server stopped writing after a failed write ({self.write_failure}); it serves reads "
                "until it is restarted, which recovers the file at its last commit"
            )
        try:
            return handler(request, session)
        except DiskFullError:
            raise  # refused before any write: nothing failed
        except StorageError as exc:
            self.write_failure = str(exc)
            log.error("a write to the file failed: %s; refusing writes from now on, serving reads", exc)
            raise

    # ------------------------------------------------------------------ handlers

    def hello(self, request: P.Hello, session: Session) -> P.HelloReply:
        session.name = request.client_name
        session.claimed_role = request.role  # less than granted, never more: see Session.role
        buffer = self.buffer
        keys = buffer.transition_keys
        sampling = {**describe_tables(buffer.tables, self._writer_tables),
                    "priority_publish_interval": self.priority_publish_interval,
                    # (a JSON string: the observation keys and reward / end-flag leaves; none: no finals kept)
                    "transition_keys": None if keys is None else keys.to_json()}
        return P.HelloReply(
            request.request_id, buffer.space.to_json(), buffer.capacity, len(buffer), buffer.num_episodes,
            __version__, P.PROTOCOL_VERSION, self.limits, self.read_endpoint, buffer.replay_id, self.instance_id,
            sampling, self.local_file,
        )

    def _writer(self, session: Session, segment_id: int) -> SegmentWriter:
        writer = session.segments.get(segment_id)
        if writer is None:
            if segment_id in self._segment_owner:
                raise SegmentStateError(f"segment {segment_id} belongs to another client; a client may only use "
                                        "the segments it opened")
            raise SegmentStateError(
                f"no open segment {segment_id} for this client (never opened, already committed or aborted, "
                "or aborted because the client went silent or reconnected)"
            )
        return writer

    def _close_segment(self, session: Session, segment_id: int) -> SegmentWriter:
        writer = self._writer(session, segment_id)
        del session.segments[segment_id]
        self._segment_owner.pop(segment_id, None)
        return writer

    def open_segment(self, request: P.OpenSegment, session: Session) -> P.OpenSegmentReply:
        if len(session.segments) >= self.limits.max_open_segments_per_client:
            raise LimitExceededError(
                f"this client already has {len(session.segments)} open segments, the limit "
                f"max_open_segments_per_client={self.limits.max_open_segments_per_client}; commit or abort some"
            )
        segment_id = self._next_segment_id
        self._next_segment_id += 1
        session.segments[segment_id] = self.buffer.open_segment_writer()
        self._segment_owner[segment_id] = session.identity
        return P.OpenSegmentReply(request.request_id, segment_id)

    def room_on_disk(self, incoming: int, what: str) -> None:
        """Refuse `incoming` bytes of new rows while the disk is below the reserve (see disk.py).

        Raises:
            DiskFullError: the disk is below the reserve; nothing was written.
        """
        self.disk.room(incoming, what)

    def _check_segment_rows(self, rows: int) -> None:
        """Refuse a segment of `rows` rows over the limit, or over the capacity (it could never be
        committed: refused now, before the rows take disk or memory)."""
        if rows > self.limits.max_rows_per_segment:
            raise LimitExceededError(
                f"the segment would have {rows} rows, over the limit max_rows_per_segment="
                f"{self.limits.max_rows_per_segment}; commit it and start another"
            )
        capacity = self.buffer.capacity
        if capacity is not None and rows > capacity:
            raise LimitExceededError(
                f"the segment would have {rows} rows, more than the buffer's capacity of {capacity} "
                "rows, so it could never be committed; commit episodes of at most the capacity"
            )

    def _add_rows(self, writer: SegmentWriter, request: P.Append | P.PushEpisode, borrow: bool = False) -> None:
        num_rows = request.num_rows
        self._check_segment_rows(len(writer) + num_rows)
        checked = self.buffer.schema.validate_stored(request.arrays, num_rows)
        self.room_on_disk(num_rows * self.buffer.storage.row_bytes, f"stage {num_rows} rows")
        # The priorities are checked against the tables before any row is kept.
        writer.extend_stored(checked, num_rows, P.priorities_from_wire(request), borrow=borrow)
        self.stats.rows_in += num_rows
        self.stats.bytes_in += sum(a.nbytes for a in checked.values())

    def append(self, request: P.Append, session: Session) -> P.AppendReply:
        writer = self._writer(session, request.segment_id)
        try:
            self._add_rows(writer, request)
        except BaseException:
            if writer.state != "open":  # the file refused the rows: the segment is gone
                session.segments.pop(request.segment_id, None)
                self._segment_owner.pop(request.segment_id, None)
                self.stats.aborts += 1
            raise
        return P.AppendReply(request.request_id, len(writer))

    def _final(self, request: P.Commit | P.PushEpisode) -> Any:
        """The episode's final observation a commit or push carries (checked), or None."""
        return self.buffer.finals_from_stored(request.finals, 1)[0]

    def _commit(self, writer: SegmentWriter, key: bytes | None, final: Any = None) -> tuple[int | None, int | None, int]:
        # Group commit: the episode is placed now and published by `publish()`, once for every
        # commit the writer loop handled in one pass, before any of their replies leaves.
        receipt = self.buffer.commit_segment(writer, publish=False, idempotency_key=key, final=final)
        self.unpublished += 1
        self.stats.commits += 1
        if receipt.length == 0:
            return None, None, 0  # nothing recorded: no id was given
        return receipt.episode_id, receipt.first_row_id, receipt.length

    def _committed(self, key: bytes | None, length: int | None) -> tuple[int, int, int] | None:
        """The receipt of an episode already committed with `key` (a retry): answered again,
        after the pass's publish like any commit, and nothing is committed twice."""
        receipt = self.buffer.receipt_for(key, length) if key is not None else None
        return None if receipt is None else (receipt.episode_id, receipt.first_row_id, receipt.length)

    def commit(self, request: P.Commit, session: Session) -> P.CommitReply:
        # A retry usually finds its segment gone (committed); a key reused on another segment of
        # another length is refused here, with the segment left open.
        open_writer = session.segments.get(request.segment_id)
        known = self._committed(request.idempotency_key, None if open_writer is None else len(open_writer))
        if known is not None:
            if open_writer is not None:
                self._close_segment(session, request.segment_id).abort()
            return P.CommitReply(request.request_id, *known)
        writer = self._writer(session, request.segment_id)
        # Before the segment is closed: refused for a full disk or a bad final, it stays open.
        self.room_on_disk(len(writer) * self.buffer.storage.row_bytes, f"commit a segment of {len(writer)} rows")
        final = self._final(request)
        writer = self._close_segment(session, request.segment_id)
        return P.CommitReply(request.request_id, *self._commit(writer, request.idempotency_key, final))

    def abort(self, request: P.Abort, session: Session) -> P.AbortReply:
        writer = self._close_segment(session, request.segment_id)
        writer.abort()
        self.stats.aborts += 1
        return P.AbortReply(request.request_id)

    def push_episode(self, request: P.PushEpisode, session: Session) -> P.PushEpisodeReply:
        known = self._committed(request.idempotency_key, request.num_rows)
        if known is not None:
            return P.PushEpisodeReply(request.request_id, *known)
        final = self._final(request)
        writer = self.buffer.open_segment_writer()
        try:
            # Committed at once: the writer may keep the received arrays, uncopied, until then.
            self._add_rows(writer, request, borrow=True)
            return P.PushEpisodeReply(request.request_id, *self._commit(writer, request.idempotency_key, final))
        finally:
            if writer.state == "open":
                writer.abort()

    def push_episodes(self, request: P.PushEpisodes, session: Session) -> P.PushEpisodesReply:
        """Commit k whole episodes of one message, each with its own key. Every check (rows, keys,
        limits, the disk's reserve) passes before the first is written: a refusal writes none."""
        lengths = [int(n) for n in request.lengths]
        keys = [bytes(key) for key in request.keys]
        self._check_segment_rows(max(lengths))
        known = [self._committed(key, n) for key, n in zip(keys, lengths)]  # refuses a key of another length
        new_rows = sum(n for n, receipt in zip(lengths, known) if receipt is None)
        capacity = self.buffer.capacity
        if capacity is not None and new_rows > capacity:  # placed at once, they must fit together
            raise LimitExceededError(
                f"a push_episodes message of {new_rows} rows to commit is more than the buffer's capacity of "
                f"{capacity} rows; send fewer episodes per message"
            )
        checked = self.buffer.schema.validate_stored(request.arrays, request.num_rows)
        finals = self.buffer.finals_from_stored(request.finals, len(lengths), request.has_final)  # checked first
        row_bytes = self.buffer.storage.row_bytes
        self.room_on_disk(new_rows * row_bytes, f"commit {len(lengths)} episodes of {new_rows} rows")
        receipts = np.empty((len(lengths), 3), dtype=np.int64)
        new = [i for i, receipt in enumerate(known) if receipt is None]
        for i, receipt in enumerate(known):
            if receipt is not None:
                receipts[i] = receipt
        if new:
            rows, priorities = checked, P.priorities_from_wire(request)
            if len(new) < len(lengths):  # a retry of which some episodes were applied: the others alone
                starts = np.concatenate([[0], np.cumsum(lengths)])
                pick = np.concatenate([np.arange(starts[i], starts[i + 1]) for i in new])
                rows = {path: arr[pick] for path, arr in checked.items()}
                priorities = None if priorities is None else {t: p[pick] for t, p in priorities.items()}
            writer = self.buffer.open_segment_writer()
            try:
                # Committed at once: the writer may keep the received arrays, uncopied, until then.
                writer.extend_stored(rows, new_rows, priorities, borrow=True)
                placed = self.buffer.commit_episodes(writer, [lengths[i] for i in new], [keys[i] for i in new],
                                                     publish=False, finals=[finals[i] for i in new])
            finally:
                if writer.state == "open":
                    writer.abort()
            for i, receipt in zip(new, placed):
                receipts[i] = receipt
            self.unpublished += 1
            self.stats.commits += len(new)
            self.stats.rows_in += new_rows
            self.stats.bytes_in += new_rows * row_bytes
        return P.PushEpisodesReply(request.request_id, receipts)

    def update_priorities(self, request: P.UpdatePriorities, session: Session) -> P.UpdatePrioritiesReply:
        """Set priorities (any client: an actor's own, a learner's TD errors). Applied to the
        writer's tree at once; the reply leaves after the publish that writes them to the file
        and shows them to the readers (at the end of this pass, or up to
        `priority_publish_interval` later: see `needs_publish`). Its `seq` names that publish
        (none for an update that changed nothing); the client's later reads ask for at least it."""
        if self.write_failure is not None:
            raise StorageError(f"this server stopped writing after a failed write ({self.write_failure}); it serves "
                               "reads until it is restarted")
        pending = self.updates_pending
        try:
            ignored = self.buffer.update_priorities(request.row_ids, request.priorities, table=request.table)
        except StorageError as exc:  # a checkpoint or the log's write failed: as any failed write
            self.write_failure = str(exc)
            log.error("a write to the file failed: %s; refusing writes from now on, serving reads", exc)
            raise
        if (now_pending := self.updates_pending) and not pending:
            self._updates_since = time.monotonic()
        return P.UpdatePrioritiesReply(request.request_id, ignored, self.buffer.published.seq + now_pending)

    @property
    def updates_pending(self) -> bool:
        """Whether priority updates wait for a publish (never after a failed write: the file
        takes no more, and the loop must not retry it on every turn)."""
        view, published = self.buffer.view, self.buffer.published
        return self.write_failure is None and any(now.plog > then.plog for now, then in zip(view.tables, published.tables))

    def updates_due_in(self) -> float | None:
        """Seconds until the priority updates not yet published must be (None: none wait)."""
        if not self.updates_pending:
            return None
        return max(0.0, self._updates_since + self.priority_publish_interval - time.monotonic())

    def publish(self, force: bool = False) -> bool:
        """Publish the commits placed since the last call (flushed; with fsync, on disk), and the
        priority updates applied since the last publish when they are due (`priority_publish_interval`
        after the first of them) or `force` (a read served here must see them).

        Returns:
            False when priority updates were left for a later publish (their replies wait for it),
            True when nothing waits for a publish any more.

        Raises:
            StorageError: the file could not take them; the service stops writing. Commits whose
                episode id is below `buffer.published.ep_end` did reach the file all the same (an
                eviction published them on the way): `is_durable` tells them apart.
        """
        if not self.unpublished:
            due = self.updates_due_in()
            if due is None:
                return True
            if due > 0 and not force:
                return False
        try:
            self.buffer.flush(fsync=self.fsync)
        except StorageError as exc:
            self.write_failure = str(exc)
            log.error("publishing commits failed: %s; refusing writes from now on, serving reads", exc)
            raise
        finally:
            self.unpublished = 0
        return True

    def is_durable(self, reply: P.Reply) -> bool:
        """Whether what a reply acknowledges is in the file as published (after a failed publish):
        a commit's episodes, or a priority update's publish."""
        if isinstance(reply, P.UpdatePrioritiesReply):
            return int(reply.seq) <= self.buffer.published.seq
        if isinstance(reply, P.PushEpisodesReply):
            return bool(len(reply.episodes)) and int(reply.episodes[:, 0].max()) < self.buffer.published.ep_end
        episode_id = getattr(reply, "episode_id", None)
        return episode_id is None or episode_id < self.buffer.published.ep_end

    def info(self, request: P.Info, session: Session) -> P.InfoReply:
        return P.InfoReply(request.request_id, self.snapshot())

    def heartbeat(self, request: P.Heartbeat, session: Session) -> P.HeartbeatReply:
        return P.HeartbeatReply(request.request_id)

    def cancel(self, request: P.Cancel, session: Session) -> P.CancelReply:
        """Drop the client's own samples still waiting for the rate limit (named by request id):
        their draws are never made, and they get no reply but this one. Any other request named
        is left alone (served already, or not a sample, or another client's)."""
        named = {int(request_id) for request_id in request.request_ids}

        def keep(parked: Parked) -> bool:
            identity, waiting, _, _ = parked
            return not (identity == session.identity and waiting.request_id in named and waiting.DRAWS)

        dropped = self.waiting.drop(keep)
        return P.CancelReply(request.request_id, np.array([w.payload[1].request_id for w in dropped], np.uint64))

    def snapshot(self) -> dict[str, Any]:
        """Scalar figures of the service (the INFO reply, the stats command, metrics)."""
        info = self.buffer.info()
        uptime = time.monotonic() - self.stats.started
        path = self.buffer.storage.filename
        stats: dict[str, Any] = {
            **info,
            "instance_id": self.instance_id,
            "open_segments": self.open_segments,
            "clients": len(self.sessions),
            "rows_in": self.stats.rows_in,
            "bytes_in": self.stats.bytes_in,
            "commits": self.stats.commits,
            "aborts": self.stats.aborts,
            "requests": self.stats.requests,
            "errors": self.stats.errors,
            "rows_out": self.stats.rows_out,
            "rows_sampled": self.stats.rows_sampled, "role": "writer",  # (readers' rows_sampled: added below)
            # The file served, by device and inode: a learner drawing from it itself checks it is still this one.
            "file_device": (self.local_file or {}).get("device"), "file_inode": (self.local_file or {}).get("inode"),
            "file_bytes": os.path.getsize(path) if path and os.path.exists(path) else 0,
            "uptime": round(uptime, 3),
            "server_version": __version__,
            "sample_wait_s": round(self.waiting.waited_now("sample"), 6),
            "insert_wait_s": round(self.waiting.waited_now("insert"), 6),
            "waiting_samples": self.waiting.count("sample"),
            "waiting_inserts": self.waiting.count("insert"),
            "writer_samples": self.writer_samples,
        }
        if self._extra_stats is not None:
            for key, value in self._extra_stats().items():
                stats[key] = stats.get(key, 0) + value if isinstance(value, int) and key in stats else value
        return stats
