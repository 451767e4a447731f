"""What an actor knows of its server, and the plans that commit episodes. Pure: no socket, no lock.

`ActorState` is built from the server's hello: the space and its codec, the sizes an episode is
cut into (a streamed episode's messages, a push of several whole episodes), the times a commit
may take. `push_request` builds the message that commits whole episodes; `send_commit` and
`settle_commit` send a commit and wait for its reply, sending it again with the same idempotency
key while none comes: the server never stores it twice.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.ops import WRITER, Now, Plan, RequestFactory, Send, Sleep, Wait, checked
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, ProtocolError, ServerUnavailableError
from h5replay.priorities import Given, check_by_table, check_given_priorities, join_priorities
from h5replay.records import Receipt
from h5replay.sampling import described_samplers, rows_at_once
from h5replay.spaces import Schema, Space, space_from_json
from h5replay.transitions import final_schema

__all__ = [
    "check_settle_timeout",
    "ActorState", "NotSentError", "Ready", "Retried", "Settled", "actor_hello", "episode_entries", "group_pushes", "own_copies",
    "push_request", "receipts", "send_commit", "settle_commit",
]


class NotSentError(ServerUnavailableError):
    """A request that never left this client (no server connected in time): not in doubt."""


class ActorState:
    """One actor's knowledge of one server (from its `hello`), shared by its segments and pushes.

    Args:
        config: the client's settings (batching, timeouts, commit attempts, rate_limit_timeout).
        hello: the server's hello reply.
    """

    def __init__(self, config: ClientConfig, hello: P.HelloReply) -> None:
        self.config = config
        self.limits = hello.limits
        self.space: Space = space_from_json(hello.space)
        self.capacity = hello.capacity
        self.server_version = hello.server_version
        self.replay_id: str = hello.replay_id
        self.instance_id: str = hello.instance_id
        self.samplers = described_samplers(hello.sampling)  # the server's tables (None: it does not say)
        self.final_schema = final_schema(self.space, hello.sampling)  # None: the server keeps no finals
        #: Seconds the server may hold a commit back (its rate limit), 0 when it has none.
        self.commit_hold = config.rate_limit_timeout if hello.sampling.get("writer_samples") else 0.0
        #: Seconds a commit or push may take in all: `commit_attempts` sends, each waiting `timeout`
        #: for its reply, and the rate limit's hold when the server has one.
        self.commit_timeout = config.commit_attempts * config.timeout + self.commit_hold
        self.schema = Schema(self.space)
        self.row_bytes = self.schema.row_bytes
        # Rows per message: the client's batching settings, within the server's message limits
        # (leaving room for the header).
        room = max(1, self.limits.max_message_bytes - P.ROWS_MESSAGE_OVERHEAD)
        by_bytes = min(config.batch_bytes // max(1, self.row_bytes), room // max(1, self.row_bytes))
        #: Rows of one message of a streamed episode.
        self.rows_per_message = max(1, min(config.batch_rows, self.limits.max_rows_per_message, by_bytes))
        #: Rows of whole episodes one `push_episodes` message carries: not bound by `batch_rows`,
        #: which sizes the messages of a streamed episode, but by the capacity (the server places a
        #: message's episodes at once) and by the rate limit's window (the server admits a message
        #: whole: one bigger than the window could never go ahead).
        self.rows_per_push = min(
            self.capacity or sys.maxsize,
            rows_at_once(hello.sampling, sampling=False) or sys.maxsize,
            max(self.rows_per_message, min(self.limits.max_rows_per_message, by_bytes)),
        )

    @property
    def keeps_finals(self) -> bool:
        """Whether the server keeps episodes' final observations (`serve --observation-keys`)."""
        return self.final_schema is not None

    def encode_one(self, step: Any) -> dict[str, np.ndarray]:
        """One step checked against the server's space, in storage form (a batch of one row)."""
        return self.schema.encode_one(step)

    def encode_batch(self, batch: Any) -> tuple[dict[str, np.ndarray], int]:
        """A batch checked against the server's space, in storage form; and its number of rows."""
        return self.schema.encode_batch(batch)

    def encode_final(self, final: Any) -> dict[str, np.ndarray] | None:
        """An episode's final observation (the value of the server's one observation key, or a
        dict of its observation keys) in storage form, checked before it leaves (None: none).

        Raises:
            ConfigError: the server keeps no final observations (`serve --observation-keys`).
            SpaceMismatchError: it is not the observation part of the server's space.
        """
        if final is None:
            return None
        if self.final_schema is None:
            raise ConfigError("this server keeps no final observations: serve a file created with "
                              "--observation-keys (observation_keys=) to give episodes a final")
        schema, keys = self.final_schema
        return schema.encode_one(keys.as_observation(final))

    def check_priorities(self, priorities: Any, n: int) -> Given | None:
        """Priorities for n steps (an array for every prioritized table, or {table: array}),
        checked against the server's tables before anything leaves (None: none given).

        Raises:
            ConfigError: a bad value or count, a table the server does not have or that keeps
                no priorities, a value beyond its table's bound (names the table).
        """
        if self.samplers is None:
            return check_given_priorities(priorities, n)
        return check_by_table(priorities, n, self.samplers, whose="server")


def actor_hello(name: str) -> Plan[P.HelloReply]:
    """Introduce this actor to the server; its hello reply (space, limits, tables).

    Raises:
        ProtocolError: the answer is not a hello reply.
    """
    request_id = yield Send(WRITER, lambda rid: P.Hello(rid, name, "actor"))
    reply = checked((yield Wait(WRITER, request_id)))
    if not isinstance(reply, P.HelloReply):
        raise ProtocolError(f"expected a hello reply, got {type(reply).__name__}")
    return reply


class Ready(NamedTuple):
    """An episode ready to go in a message."""

    rows: dict[str, np.ndarray]  # by leaf, in storage form
    n: int
    priorities: Given | None
    key: bytes  # its idempotency key
    final: dict[str, np.ndarray] | None = None  # its final observation, one row a leaf (None: none)


def push_request(episodes: Sequence[Ready], limit: float) -> RequestFactory:
    """request_id -> the message that commits `episodes`: a push for one, push_episodes (their
    rows one after another, NaN priorities for steps given none) for several."""
    if len(episodes) == 1:
        one = episodes[0]
        every, tables, by_table = P.priorities_to_wire(one.priorities)
        return lambda rid: P.PushEpisode(rid, one.n, one.rows, limit, every, one.key, tables, by_table, one.final or {})
    lengths = np.array([e.n for e in episodes], dtype=np.int64)
    total = int(lengths.sum())
    arrays = {path: np.concatenate([e.rows[path] for e in episodes]) for path in episodes[0].rows}
    every, tables, by_table = P.priorities_to_wire(join_priorities([(e.priorities, e.n) for e in episodes]))
    keys = np.frombuffer(b"".join(e.key for e in episodes), dtype=np.uint8).reshape(len(episodes), -1)
    with_final = [e.final for e in episodes if e.final is not None]
    has_final = np.array([e.final is not None for e in episodes], dtype=np.uint8) if with_final else np.zeros(0, np.uint8)
    finals = {path: np.concatenate([f[path] for f in with_final]) for path in with_final[0]} if with_final else {}
    return lambda rid: P.PushEpisodes(rid, total, lengths, keys, arrays, limit, every, tables, by_table, has_final,
                                      finals)


def receipts(reply: Any) -> list[Receipt]:
    """The receipts a commit, push or push_episodes reply carries, in the order sent (an episode
    that recorded nothing: Receipt(-1, -1, 0))."""
    if isinstance(reply, P.PushEpisodesReply):
        return [Receipt(int(e), int(f), int(n)) for e, f, n in reply.episodes]
    if reply.episode_id is None or reply.first_row_id is None or reply.length == 0:
        return [Receipt(-1, -1, 0)]
    return [Receipt(int(reply.episode_id), int(reply.first_row_id), int(reply.length))]


@dataclass
class Retried:
    """A commit in flight that is sent again while no reply comes (`send_commit`)."""

    request: RequestFactory  # request_id -> the request, the same (same key) for every attempt
    timeout: float  # seconds for every attempt in all, counted from the first send
    attempts: int  # sends at most
    deadline: float  # on the driver's clock, when the last attempt gives up
    hold: float  # seconds the server may hold the first attempt back (its rate limit)
    request_id: int  # of the latest attempt
    sent_at: float  # when the latest attempt left
    attempt_timeout: float  # seconds one attempt waits for its reply (the client's timeout)


def send_commit(state: ActorState, request: RequestFactory) -> Plan[Retried]:
    """The first send of a commit (or push): `settle_commit` waits for its reply, so that other
    requests can travel in between. Its time (`commit_timeout`) counts from now.

    Raises:
        NotSentError: it could not leave (no server connected within the client's timeout).
    """
    config = state.config
    now = yield Now()
    try:
        request_id = yield Send(WRITER, request, min(config.timeout, state.commit_timeout))
    except ServerUnavailableError as exc:
        raise NotSentError(str(exc)) from exc
    return Retried(request, state.commit_timeout, config.commit_attempts, now + state.commit_timeout,
                   state.commit_hold, request_id, now, config.timeout)


def settle_commit(retried: Retried) -> Plan[P.Reply]:
    """The reply to a commit sent by `send_commit`, sending it again (same request, same key)
    when an attempt's reply does not come within the client's timeout: up to `attempts` sends in
    all, within the commit's `timeout` in all (the last attempt waits for whatever is left). The
    first attempt also waits out the server's hold (its rate limit), so that its waiting room
    never holds two copies of one commit. A refusal is raised as its exception.

    Raises:
        ServerUnavailableError: no attempt got a reply within the commit's time.
    """
    left = max(1, retried.attempts)
    while True:
        now = yield Now()
        share_end = retried.deadline if left == 1 else \
            min(retried.sent_at + retried.attempt_timeout + retried.hold, retried.deadline)
        retried.hold = 0.0
        try:
            reply: P.Reply = checked((yield Wait(WRITER, retried.request_id, max(0.001, share_end - now))))
            return reply
        except ServerUnavailableError as exc:
            left -= 1
            now = yield Now()
            if left <= 0 or now >= retried.deadline:
                raise ServerUnavailableError(
                    f"{exc} ({retried.attempts} attempt(s) within {retried.timeout:g} s)") from exc
            if share_end > now:  # a refusal that came at once (busy, shutting down): wait out this share
                yield Sleep(share_end - now)
            # Sent again: the server may have restarted, or lost the first on a broken connection.
            retried.request_id = yield from _send_again(retried)
            retried.sent_at = yield Now()


def _send_again(retried: Retried) -> Plan[int]:
    """Send a retry, waiting for a connection until the commit's deadline at most."""
    while True:
        now = yield Now()
        try:
            request_id: int = yield Send(WRITER, retried.request, min(retried.attempt_timeout, max(0.0, retried.deadline - now)))
            return request_id
        except ServerUnavailableError:
            if (yield Now()) >= retried.deadline:
                raise


def episode_entries(batches: Any, priorities: Sequence[Any] | None,
                    finals: Sequence[Any] | None) -> tuple[Sequence[Any], Sequence[Any]]:
    """The priorities and finals of `push_episodes`, one entry per episode (None where none given).

    Raises:
        ConfigError: `batches` is not a sequence of episodes, or `priorities` or `finals` has not
            one entry per episode.
    """
    if not isinstance(batches, Sequence) or isinstance(batches, (str, bytes, dict)):
        raise ConfigError(f"push_episodes takes a sequence of episodes, got {type(batches).__name__}")
    if priorities is not None and len(priorities) != len(batches):
        raise ConfigError(f"push_episodes got {len(priorities)} priority entries for {len(batches)} episodes: "
                          "give one per episode (None, or one per step)")
    if finals is not None and len(finals) != len(batches):
        raise ConfigError(f"push_episodes got {len(finals)} finals for {len(batches)} episodes: give one per "
                          "episode (None, or its final observation)")
    none = [None] * len(batches)
    return (none if priorities is None else priorities), (none if finals is None else finals)


def group_pushes(lengths: Sequence[int], rows_per_message: int, rows_per_push: int) -> list[tuple[str, list[int]]]:
    """How whole episodes of these lengths leave, in order: ("empty", [i]) records and sends
    nothing; ("streamed", [i]) goes through a segment of its own (longer than one message);
    ("push", [i, ...]) leaves in one message (one episode: a push; several: push_episodes, at most
    `rows_per_push` rows)."""
    plan: list[tuple[str, list[int]]] = []
    group: list[int] = []
    rows = 0
    for i, n in enumerate(lengths):
        if n == 0:
            plan.append(("empty", [i]))
        elif n > rows_per_message:
            if group:
                plan.append(("push", group))
                group, rows = [], 0
            plan.append(("streamed", [i]))
        else:
            if group and rows + n > rows_per_push:
                plan.append(("push", group))
                group, rows = [], 0
            group.append(i)
            rows += n
    if group:
        plan.append(("push", group))
    return plan


def own_copies(encoded: dict[str, np.ndarray], given: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """`encoded` with a copy of every array that shares memory with the caller's `given` leaves (a
    message in flight, and its retries, must not borrow arrays the caller may reuse)."""
    return {path: arr.copy() if isinstance(given.get(path), np.ndarray) and np.may_share_memory(arr, given[path])
            else arr for path, arr in encoded.items()}


#: Told how a commit ended: (receipt, None) or (None, the error).
Settled = Callable[[Receipt | None, Exception | None], None]


def check_settle_timeout(timeout: float | None) -> None:
    """Raises ConfigError unless `timeout` (of `settle`) is a number of seconds >= 0, or None."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise ConfigError(f"settle's timeout must be a number of seconds >= 0, or None, got {timeout!r}")
