"""How a read is answered: get, get_rows, sample, sample_sequences and episodes, from a ReplayBuffer.

The writer's Service (handlers.py) and the reader processes (readers.py) answer reads with the
same `read_reply`, each over its own view of the file: never from a state older than the client
has seen, never with a reply over the message limit. No sockets; pure over the buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.codecs import META_COLUMNS
from h5replay.errors import LimitExceededError, ProtocolError, ServerUnavailableError
from h5replay.storage.hdf5 import PACKED
from h5replay.storage.replay.buffer import ReplayBuffer
from h5replay.windows import unmasked

__all__ = ["read_reply", "reply_rows"]


def reply_rows(reply: P.Reply) -> int:
    """Rows a read reply carries (windows count every row)."""
    arrays = getattr(reply, "arrays", None)
    if not arrays:
        return 0
    first = next(iter(arrays.values()))
    return int(np.prod(first.shape[:2]) if reply.KIND is P.Kind.SAMPLE_SEQUENCES else first.shape[0])


def _stored(packed: bool | None) -> bool | str:
    """How rows leave: compressed leaves as stored, for a client that decodes them (it says so), else
    decoded here."""
    return PACKED if packed else False


def _check_reply_rows(buffer: ReplayBuffer, rows: int, limits: P.Limits, per_sample: int = 0) -> None:
    """Refuse, before any work, a read whose reply could not travel within the message limit
    (`per_sample`: bytes of ids and probabilities the reply adds)."""
    packed = len(getattr(buffer.storage, "compressed_leaves", ()))  # each row's record meta travels too
    size = rows * (buffer.storage.row_bytes + packed * META_COLUMNS * 8) + per_sample
    if size + P.ROWS_MESSAGE_OVERHEAD > limits.max_message_bytes:
        raise LimitExceededError(
            f"a reply of {rows} rows would be {size} bytes, over the limit max_message_bytes="
            f"{limits.max_message_bytes}; ask for fewer rows per request"
        )


def _at_least(buffer: ReplayBuffer, min_seq: int) -> None:
    """Never answer from a state older than one the client has already seen. Every publish a
    client can know of was made before it heard of it (replies that name a publish leave after
    it), so one look at the file's state row settles it: a reader never waits for a publish
    that may never come."""
    if buffer.view.seq >= min_seq:
        return
    if not buffer.is_mutable:  # the writer's own view is the newest there is
        buffer.refresh()
        if buffer.view.seq >= min_seq:
            return
    raise ServerUnavailableError(
        f"this server's newest state is publish {buffer.view.seq}, older than publish {min_seq} this client has "
        "already seen: the file was restored from an older copy, lost publishes that were never forced to the disk "
        "(a power loss without --fsync), or is another replay. A learner never reads an older state than it has "
        "seen; a new client reads this one"
    )


def _view(buffer: ReplayBuffer) -> tuple[int, int, int, int]:
    v = buffer.last_view
    return v.seq, v.generation, v.begin, v.end


def read_reply(buffer: ReplayBuffer, request: P.Request, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    """Answer a read request (get, get_rows, sample, sample_sequences, episodes) from `buffer`,
    from a state no older than the request's `min_seq`.

    Raises:
        IndexError, EvictedError, NotEnoughDataError, ConfigError: the request cannot be served as asked.
        LimitExceededError: the reply would exceed the message size limit.
        ServerUnavailableError: the file is older than what the client has seen.
        ProtocolError: `request` is not a read request.
    """
    answer = _READS.get(type(request))
    if answer is None:
        raise ProtocolError(f"{request.KIND.value} is not a read request")
    _at_least(buffer, request.min_seq)  # type: ignore[attr-defined]
    return answer(buffer, request, rng, limits)


def _get(buffer: ReplayBuffer, request: P.Get, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    _check_reply_rows(buffer, len(request.indices), limits, len(request.indices) * P.ID_BYTES)
    arrays, ids = buffer.get_at_with_ids(request.indices, decode=_stored(request.packed))
    return P.GetReply(request.request_id, *_view(buffer), ids, arrays)


def _get_rows(buffer: ReplayBuffer, request: P.GetRows, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    _check_reply_rows(buffer, len(request.row_ids), limits)
    arrays = buffer.get_rows(request.row_ids, decode=_stored(request.packed))
    return P.GetRowsReply(request.request_id, *_view(buffer), len(request.row_ids), arrays)


def _sample(buffer: ReplayBuffer, request: P.Sample, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    _check_reply_rows(buffer, request.batch_size, limits, request.batch_size * P.SAMPLE_INFO_BYTES)
    gen = rng if request.seed is None else np.random.default_rng(request.seed)
    arrays, info = buffer.sample(request.batch_size, gen, with_info=True, decode=_stored(request.packed),
                                 table=request.table, skip=request.skip or 0)
    return P.SampleReply(request.request_id, *_view(buffer), info.row_ids, info.episode_ids, info.probabilities, arrays)


def _sample_sequences(buffer: ReplayBuffer, request: P.SampleSequences, rng: np.random.Generator,
                      limits: P.Limits) -> P.Reply:
    _check_reply_rows(buffer, request.batch_size * request.length if request.with_rows else 0, limits,
                      request.batch_size * (P.SAMPLE_INFO_BYTES + (P.ID_BYTES if request.pad else 0)))
    gen = rng if request.seed is None else np.random.default_rng(request.seed)
    arrays, info = buffer.sample_sequences(
        request.batch_size, request.length, gen, with_info=True, decode=_stored(request.packed), rows=request.with_rows,
        table=request.table, pad=bool(request.pad),
    )
    valid = np.zeros(0, np.int64) if info.valid_steps is None else info.valid_steps  # the client rebuilds the mask
    return P.SampleSequencesReply(
        request.request_id, *_view(buffer), info.row_ids, info.episode_ids, info.probabilities,
        unmasked(arrays) if arrays else {}, valid,
    )


def _sample_transitions(buffer: ReplayBuffer, request: P.SampleTransitions, rng: np.random.Generator,
                        limits: P.Limits) -> P.Reply:
    keys = buffer.transition_keys
    extra = 0 if keys is None else sum(leaf.row_bytes for _, leaf in keys.observation_space(buffer.space).leaves()) + 4
    _check_reply_rows(buffer, request.batch_size, limits, request.batch_size * (P.SAMPLE_INFO_BYTES + 1 + extra))
    gen = rng if request.seed is None else np.random.default_rng(request.seed)
    arrays, info = buffer.sample_transitions(request.batch_size, n_step=request.n_step, gamma=request.gamma, rng=gen,
                                             with_info=True, decode=False, table=request.table,
                                             skip=request.skip or 0)
    return P.SampleTransitionsReply(request.request_id, *_view(buffer), info.row_ids, info.episode_ids,
                                    info.probabilities, info.has_final.astype(np.uint8), arrays)


def _episodes(buffer: ReplayBuffer, request: P.Episodes, rng: np.random.Generator, limits: P.Limits) -> P.Reply:
    table = buffer.episode_table(request.first_episode or 0, request.max_episodes)
    size = table.nbytes + P.ROWS_MESSAGE_OVERHEAD
    if size > limits.max_message_bytes:
        raise LimitExceededError(
            f"a list of {len(table)} episodes is {table.nbytes} bytes, over the limit max_message_bytes="
            f"{limits.max_message_bytes}; ask for it in pages (first_episode, max_episodes: LearnerClient does)"
        )
    return P.EpisodesReply(request.request_id, *_view(buffer), table)


# How each read is answered (every kind whose READS is true has one: tests/unit/test_protocol.py).
_READS: dict[type[P.Request], Callable[[ReplayBuffer, Any, np.random.Generator, P.Limits], P.Reply]] = {
    P.Get: _get, P.GetRows: _get_rows, P.Sample: _sample, P.SampleSequences: _sample_sequences, P.Episodes: _episodes,
    P.SampleTransitions: _sample_transitions,
}
