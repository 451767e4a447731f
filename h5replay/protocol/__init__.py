"""The wire protocol: every message, its bytes, PROTOCOL_VERSION and the error codes.

This package is the one place that knows the bytes, and this module its one door: every name is
imported from here (`from h5replay import protocol as P`). It is pure (msgpack and numpy only): it
must not import zmq, open files, or touch storage, and it never pickles anything. Each module has
one job: `codec.py` the frames (encode, decode, dtypes, PROTOCOL_VERSION); `base.py` what every
message is (Kind, Message, Request, Reply, ErrorReply); `admin.py`, `writes.py` and `reads.py` the
messages of sessions, of changes to the file and of reads; `checks.py` the limits and what each
field may hold; `codes.py` the error codes and the exceptions they stand for.

A message is a list of frames. Frame 0 is a msgpack map, the header::

    {"version": 1, "kind": "append", "id": 7,
     "fields": {"segment_id": 3, "num_rows": 64},
     "arrays": [["obs/image", "|u1", [64, 84, 84, 3]], ["reward", "<f4", [64]]]}

Each array the header lists follows as its own raw frame (C order, exactly prod(shape) * itemsize
bytes). A message's own array fields (``indices``, ``row_ids``, ``episodes``: int64; ``episode_ids``:
uint64; ``probabilities``: float64) come first in the order below, then the leaf arrays keyed by leaf
path ('obs/image'; 'data' when the space is a single leaf), each in the leaf's storage dtype: bool,
int, uint, float, or fixed bytes ``S{k}`` for text.

Ids are global (see h5replay.records): a row id never changes while the row is held and is never
reused. Every read reply says which published state ("view") answered it: ``seq`` (the journal's
publish counter), ``generation`` (its clear counter) and the row ids ``begin`` (oldest held) and
``end`` (the next to be given). A learner sends the highest ``seq`` it has seen as ``min_seq``, and
a reader never answers from an older state, so a learner's view never goes back in time. The
``seq`` of an update_priorities reply is the publish that carried the update: the reply leaves
after it (at the end of the writer's pass, or up to the server's priority_publish_interval
later), so every ``seq`` a client knows names a publish the file already has.

A reply has kind "reply", ``"ok": true`` and ``"for": <the kind it answers>``. An error reply is
``{"version", "kind": "reply", "id", "ok": false, "fields": {"code", "message"}, "arrays": []}``;
that layout never changes between versions, so any client can read a refusal, and ``id`` is nil when
the request was too broken to read one.

=================  ===========  ===================================  =======================================
kind               sent by      request fields                       reply fields
=================  ===========  ===================================  =======================================
hello              any client   client_name, role                    space (JSON), capacity (int|None),
                                ('actor' | 'learner')                length, num_episodes, server_version,
                                                                     protocol_version, limits, read_endpoint,
                                                                     replay_id, instance_id, sampling
                                                                     ({name: scalar}: sampler, writer_samples)
open_segment       actor        -                                    segment_id
append             actor        segment_id, num_rows, priorities:    segment_length
                                float64 (0 or num_rows; NaN: the
                                default), leaf arrays
commit             actor        segment_id, timeout (s),             episode_id, first_row_id (nil when
                                idempotency_key (optional)           empty), length
abort              actor        segment_id                           -
push_episode       actor        num_rows, timeout, priorities, leaf  episode_id, first_row_id, length
                                arrays, idempotency_key (optional)
push_episodes      actor        num_rows, timeout, lengths: int64    episodes: int64 (k, 3) of (episode_id,
                                (k,), keys: uint8 (k, 16),           first_row_id, length), in the order sent
                                priorities, leaf arrays (the k
                                episodes' rows one after another)
update_priorities  any client   row_ids: int64 (n,), priorities:     ignored (ids no longer held), seq
                                float64 (n,)
get                learner      min_seq, indices: int64 (n,)         view, row_ids (n,), leaf arrays (n, ...)
                                (logical: 0 is the oldest row held)
get_rows           learner      min_seq, row_ids: int64 (n,)         view, leaf arrays (n, ...)
sample             learner      batch_size, seed (int|None),         view, row_ids (b,), episode_ids (b,),
                                min_seq, timeout                     probabilities (b,), leaf arrays (b, ...)
sample_sequences   learner      batch_size, length, seed, min_seq,   view, row_ids, episode_ids, probabilities
                                with_rows (bool), timeout, pad       (of each window's first row), leaf
                                (bool, optional: windows may start   arrays (b, length, ...) when with_rows,
                                in an episode's last length-1 steps) valid_steps: int64 (b,) when padded
sample_transitions learner      batch_size, n_step, gamma, seed,     view, row_ids, episode_ids, probabilities,
                                min_seq, timeout, table (optional)   has_final: uint8 (b,), leaf arrays (b, ...)
                                                                     with next/<observation leaf> and discount
episodes           learner      min_seq, first_episode (optional),   view, episodes: int64 (n, 3) of
                                max_episodes (optional)              (episode_id, first_row_id, length)
info               any client   -                                    stats: {name: scalar}
heartbeat          any client   -                                    -
cancel             learner      request_ids: uint64 (n,) of its own  request_ids: uint64, those dropped (they
                                samples                              get no other reply)
reply              server       answers any request                  on error: code, message
=================  ===========  ===================================  =======================================

"view" is the four fields seq, generation, begin, end.

``idempotency_key`` (16 bytes, msgpack bin; left out of the fields when there is none, so messages
without it are those of earlier version 3 clients, which may leave out ``timeout`` too: 0): made by the client once per episode and sent
again with every retry of that commit or push. A server that already committed an episode with
that key (one of its last `idempotency_window` episodes, see h5replay/storage/replay/keys.py) answers
with that episode's receipt and commits nothing; a key whose episode has another length is
refused (``unknown_segment``).

``push_episodes`` commits k whole episodes in one message (short episodes, vectorized
environments): every episode has at least one row and its own key, no two the same; the server
checks them all before it writes any, commits each (a key it already has answers with that
episode's receipt) and answers once they are all published. Added within version 3: an older
version 3 server refuses it as an unknown kind (``bad_request``).

``episodes`` with ``first_episode`` / ``max_episodes`` (added within version 3) lists at most that
many episodes from that id on: a list longer than a message is read in pages. Without them the
whole list comes in one reply, or is refused when it would not fit one.

``priority_tables`` (a list of table names) with ``table_priorities`` (float64, one row per table
named, one value per row of the message; NaN: none given) on append, push_episode and push_episodes
give priorities by table (an actor's ``priorities={"replay": p}``), beside ``priorities`` for every
prioritized table; a table named here overrides ``priorities`` where it gives a value. The server
refuses a name that is not one of its prioritized tables (``bad_request``) before it stores any row
of the message. Added within version 3; both are left out when none are given.

Final observations (added within version 3, for a file with observation keys; the hello's
``sampling.transition_keys`` names them): commit and push_episode may carry ``finals``, the
episode's final observation as one row per observation leaf; push_episodes ``has_final``
(uint8, one per episode) and ``finals`` with a row for each episode it marks. They travel as leaf
arrays named ``/final/<leaf path>`` after the rows' own (no leaf path starts with ``/``). The
server checks them against the observation part of its space before it writes anything.

``cancel`` drops the client's own samples that still wait for the rate limit (a learner leaving a
``batches`` loop, or giving up on the rest of a split sample), so that no row is drawn for a
caller that no longer waits; the others are served as usual. Added within version 3.

``timeout`` (seconds, >= 0): how long the server may hold a commit, push_episode or sample back for
the rate limit before refusing it with ``rate_limited`` (0: refuse at once). When the hello's
``sampling.writer_samples`` is true (a rate limit, or rows removed as they are sampled), learners
send sample and sample_sequences to the writer's endpoint: only the writer may count them.

Every request gets exactly one reply with the same ``request_id``. A changed message bumps
PROTOCOL_VERSION and extends tests/property/test_protocol_roundtrip.py.
"""

from __future__ import annotations

from h5replay.protocol.admin import Cancel, CancelReply, Heartbeat, HeartbeatReply, Hello, HelloReply, Info, InfoReply
from h5replay.protocol.base import ErrorReply, Kind, Message, Reply, Request
from h5replay.protocol.checks import (
    DEFAULT_LIMITS,
    ID_BYTES,
    IDEMPOTENCY_KEY_BYTES,
    ROLES,
    ROWS_MESSAGE_OVERHEAD,
    SAMPLE_INFO_BYTES,
    Array,
    Arrays,
    Limits,
)
from h5replay.protocol.codec import PROTOCOL_VERSION, decode, encode, peek_request_id
from h5replay.protocol.codes import ERROR_CLASSES, ErrorCode, error_to_exception, exception_to_error
from h5replay.protocol.reads import (
    Episodes,
    EpisodesReply,
    Get,
    GetReply,
    GetRows,
    GetRowsReply,
    ReadReply,
    Sample,
    SampleReply,
    SampleSequences,
    SampleSequencesReply,
    SampleTransitions,
    SampleTransitionsReply,
)
from h5replay.protocol.writes import (
    Abort,
    AbortReply,
    Append,
    AppendReply,
    Commit,
    CommitReply,
    OpenSegment,
    OpenSegmentReply,
    PushEpisode,
    PushEpisodeReply,
    PushEpisodes,
    PushEpisodesReply,
    UpdatePriorities,
    UpdatePrioritiesReply,
    priorities_from_wire,
    priorities_to_wire,
)

__all__ = [
    "PROTOCOL_VERSION", "IDEMPOTENCY_KEY_BYTES", "ROWS_MESSAGE_OVERHEAD", "ID_BYTES", "SAMPLE_INFO_BYTES", "ROLES", "Kind", "ErrorCode", "ERROR_CLASSES", "Limits", "DEFAULT_LIMITS",
    "Message", "Request", "Reply", "Hello", "OpenSegment", "Append", "Commit", "Abort", "PushEpisode",
    "PushEpisodes", "UpdatePriorities", "Get", "GetRows", "Sample", "SampleSequences", "SampleTransitions", "Episodes", "Info", "Heartbeat", "Cancel",
    "HelloReply", "CancelReply",
    "OpenSegmentReply", "AppendReply", "CommitReply", "AbortReply", "PushEpisodeReply", "PushEpisodesReply",
    "UpdatePrioritiesReply",
    "GetReply",
    "GetRowsReply", "SampleReply", "SampleSequencesReply", "SampleTransitionsReply", "EpisodesReply", "InfoReply", "HeartbeatReply",
    "ErrorReply", "ReadReply",
    "Array", "Arrays",
    "encode", "decode", "peek_request_id", "error_to_exception", "exception_to_error",
    "priorities_to_wire", "priorities_from_wire",
]
