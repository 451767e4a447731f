"""Plans of the draws: `sample`, `sample_sequences` (padded or not) and `sample_transitions`.

A batch bigger than a message is drawn in parts (seeds seed, seed + 1, ...), each within the
server's limits and its rate limit's step. From a table whose draws change the server's state (a
queue, a rate limit), no row a draw handed out is dropped: rows kept from a call that failed
part-way come first, and when a part of this call fails, what was drawn is kept and the error
raised saying how many. Every plan returns a `Drawn`: what was drawn, and how to make the
caller's result of it; a driver whose caller went away (a cancelled coroutine) keeps its parts
instead (`Drawn.keep`). Pure plans (see ops.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.exchange import draw_all, fresh, joined, read_many
from h5replay.client._core.ops import WRITER, Now, Plan, RequestFactory
from h5replay.client._core.reads import rows_by_id, server_stats
from h5replay.client._core.state import LearnerState
from h5replay.client._kept import Part, join_parts, kept_error
from h5replay.client._local import LocalRows
from h5replay.client._reads import TableDraws, _chunks, _positive, _request, _seed, sample_info
from h5replay.errors import ConfigError, ProtocolError
from h5replay.records import SampleInfo
from h5replay.spaces import Schema
from h5replay.transitions import check_n_step
from h5replay.windows import check_pad_space, masked, unmasked, window_rows

__all__ = ["Drawn", "local_view", "sample", "sample_requests", "sample_sequences", "sample_transitions",
           "window_requests"]


@dataclass
class Drawn:
    """What a draw plan drew. `kind` is set when a consuming draw drew `parts` (no other caller
    gets those rows: when this one went away they must be kept); `finish` makes the result."""

    kind: Hashable | None
    parts: list[Part]
    finish: Callable[[list[Part]], Any]

    def result(self) -> Any:
        return self.finish(self.parts)

    def keep(self, state: LearnerState) -> None:
        """Nobody takes the result: a consuming draw's rows go back to the kept ones, first."""
        if self.kind is not None:
            state.kept.give_back(self.kind, self.parts)


def _rng(state: LearnerState, seed: int | None) -> np.random.Generator:
    """The generator a part is drawn with: as a reader makes it from a seed (the same rows), else
    this client's own."""
    return state.rng if seed is None else np.random.default_rng(seed)


def _ready(value: Any) -> Drawn:
    return Drawn(None, [], lambda _: value)


def sample_requests(state: LearnerState, size: int, seed: int | None, t: TableDraws) -> list[RequestFactory]:
    """The Sample requests of one batch: one per message's (and rate limit step's) worth of rows."""
    limit = state.config.rate_limit_timeout
    return [_request(P.Sample, hi - lo, _seed(seed, k), state.min_seq, limit, t.asked, state.packed, _skip(lo, t))
            for k, (lo, hi) in enumerate(_chunks(size, t.rows_per_sample))]


def local_view(state: LearnerState, t: TableDraws) -> Plan[LocalRows | None]:
    """This client's own view of the server's file, when draws from `t` are made from it
    (client/_local.py): on the file's host, from a table whose draws change nothing on the server,
    and the server confirmed (at most every CONFIRM_INTERVAL seconds) that it serves that file."""
    local = state.local
    if local is None or not state.reads_locally(t):
        return None
    now = yield Now()
    if local.due(now):
        local.confirm((yield from server_stats(WRITER)), now)
    return local if local.usable else None


def drawn_here(state: LearnerState, local: LocalRows, method: str, size: int, per: int, seed: int | None,
               draw: Callable[[int, int | None, int], tuple[Any, ...]],
               with_info: bool = True) -> tuple[dict[str, np.ndarray], SampleInfo | None] | None:
    """(rows, info: None without `with_info`) of `size` draws made from this client's view:
    `draw(n, seed, lo)` gives the arguments of `ReplayBuffer.<method>` for the part from `lo` on.
    With a seed, in the parts (of `per`) and seeds the server would draw, so the rows are the
    ones it would give; None when the view is given up (then draw over the socket)."""
    parts = [(0, size)] if seed is None else _chunks(size, per)  # without a seed: one draw of them all
    got: list[tuple[dict[str, np.ndarray], SampleInfo | None]] = []
    for k, (lo, hi) in enumerate(parts):
        args, kwargs = draw(hi - lo, _seed(seed, k), lo)
        drawn = local.draw(method, state.min_seq, *args, with_info=with_info, **kwargs)
        if drawn is None:
            return None
        arrays, info, view = drawn
        state.observe_view(view)
        got.append((arrays, info))
    info = got[0][1]
    for _, more in got[1:]:
        info = info.concatenate(more) if info is not None and more is not None else None
    return joined([arrays for arrays, _ in got], list(got[0][0])), info


def _skip(lo: int, t: TableDraws) -> int | None:
    """What the part of a batch from row `lo` on asks an in-order sampler to pass over: the rows
    the parts before it drew (a draw that removes rows has removed them already)."""
    return lo if lo and not t.consuming else None


def window_requests(state: LearnerState, size: int, steps: int, seed: int | None, t: TableDraws,
                    pad: bool = False) -> list[RequestFactory] | None:
    """The SampleSequences requests of one batch with its rows, or None when one window is bigger
    than a message (then the windows are drawn first and read by row ids)."""
    windows = t.rows_per_sample // steps
    if windows < 1:
        return None
    limit = state.config.rate_limit_timeout
    return [_request(P.SampleSequences, hi - lo, steps, _seed(seed, k), state.min_seq, True, limit, t.asked,
                     pad or None, state.packed)
            for k, (lo, hi) in enumerate(_chunks(size, windows))]


def consume(state: LearnerState, kind: Hashable, size: int, requests: Callable[[int], list[RequestFactory]],
            finish: Callable[[list[Part]], Any]) -> Plan[Drawn]:
    """`size` rows (windows) of a draw that changes the server's state: those kept first, then
    `requests(rest)`; when one of those fails, everything drawn is kept, in order, and the error
    raised (saying how many were kept)."""
    parts = state.kept.take(kind, size)
    have = sum(len(info) for _, info in parts)
    if have < size:
        try:
            yield from fresh(state)
            drawn, error = yield from draw_all(state, "writer", requests(size - have))
        except BaseException:
            state.kept.give_back(kind, parts)  # what was taken out goes back before the failure leaves
            raise
        parts += drawn
        if error is not None:
            state.kept.give_back(kind, parts)
            raise kept_error(error, sum(len(info) for _, info in parts))
    return Drawn(kind, parts, finish)


def decoded(schema: Schema, with_info: bool) -> Callable[[list[Part]], Any]:
    """The caller's result of drawn parts: the decoded batch (with its SampleInfo when asked)."""
    def finish(parts: list[Part]) -> Any:
        arrays, info = join_parts(parts, schema.names)
        batch = schema.decode(arrays)
        return (batch, info) if with_info else batch
    return finish


def sampled(state: LearnerState, replies: list[Any], with_info: bool, schema: Schema | None = None) -> Any:
    """The batch the replies of one (non-consuming) draw carry, and its SampleInfo when asked."""
    schema = schema or state.schema
    batch = schema.decode(joined([state.rows_of(r) for r in replies], schema.names))
    return (batch, sample_info(replies)) if with_info else batch


def sample_many(state: LearnerState, factories: list[RequestFactory], t: TableDraws) -> Plan[list[Any]]:
    """Sample requests go to whoever draws them: readers, or the writer when samples change the
    buffer (then each may wait up to `rate_limit_timeout` for the rate limit)."""
    return (yield from read_many(state, t.samples, factories, state.draw_timeout(t)))


def sample(state: LearnerState, batch_size: Any, seed: int | None, with_info: bool, table: str | None) -> Plan[Drawn]:
    """`batch_size` rows drawn by the server's sampler (see LearnerClient.sample)."""
    size = _positive(batch_size, "batch_size")
    t = state.table(table)
    if t.consuming:
        return (yield from consume(state, ("rows", *t.kind), size, lambda n: sample_requests(state, n, seed, t),
                                   decoded(state.schema, with_info)))
    yield from fresh(state)
    local = yield from local_view(state, t)
    if local is not None:
        here = drawn_here(state, local, "sample", size, t.rows_per_sample, seed,
                          lambda n, part_seed, lo: ((n, _rng(state, part_seed)), {"table": t.asked, "skip": _skip(lo, t) or 0}),
                          with_info)
        if here is not None:
            arrays, info = here
            batch = state.schema.decode(arrays)
            return _ready((batch, info) if with_info else batch)
    replies = yield from sample_many(state, sample_requests(state, size, seed, t), t)
    return _ready(sampled(state, replies, with_info))


def sample_sequences(state: LearnerState, batch_size: Any, length: Any, seed: int | None, with_info: bool,
                     table: str | None, pad: bool) -> Plan[Drawn]:
    """`batch_size` windows of `length` consecutive steps (see LearnerClient.sample_sequences)."""
    size, steps = _positive(batch_size, "batch_size"), _positive(length, "length")
    if pad:
        check_pad_space(state.space)
    t = state.table(table)

    def finish(drawn: tuple[Any, SampleInfo]) -> Any:
        batch, info = drawn
        if pad:
            batch = masked(batch, _valid_steps(info), steps)
        return (batch, info) if with_info else batch

    yield from fresh(state)
    requests = window_requests(state, size, steps, seed, t, pad)
    if requests is not None and t.consuming:  # a rate limit counts them: kept on a failure, as `sample`
        kind = ("padded windows" if pad else "windows", steps, *t.kind)
        rows = decoded(state.schema, True)
        return (yield from consume(state, kind, size, lambda n: window_requests(state, n, steps, seed, t, pad) or [],
                                   lambda parts: finish(rows(parts))))
    local = yield from local_view(state, t)
    if local is not None:
        per = t.rows_per_sample // steps if requests is not None else state.limits.max_rows_per_message
        here = drawn_here(state, local, "sample_sequences", size, per, seed,
                          lambda n, part_seed, lo: ((n, steps, _rng(state, part_seed)), {"table": t.asked, "pad": pad}))
        arrays, info = here if here is not None else ({}, None)
        if info is not None:  # (drawn with their info: padded windows need it)
            return _ready(finish((state.schema.decode(unmasked(arrays)), info)))
    if requests is not None:
        return _ready(finish(sampled(state, (yield from sample_many(state, requests, t)), True)))
    return _ready(finish((yield from _by_row_ids(state, size, steps, seed, t, pad))))


def _by_row_ids(state: LearnerState, size: int, steps: int, seed: int | None, t: TableDraws,
                pad: bool) -> Plan[tuple[Any, SampleInfo]]:
    """Windows bigger than a message: drawn first, then each read by row ids (a padded one up to
    its episode's last row)."""
    limit = state.config.rate_limit_timeout
    replies = yield from sample_many(state, [
        _request(P.SampleSequences, hi - lo, steps, _seed(seed, k), state.min_seq, False, limit, t.asked, pad or None)
        for k, (lo, hi) in enumerate(_chunks(size, state.limits.max_rows_per_message))
    ], t)
    info = sample_info(replies)
    first = info.row_ids.astype(np.int64)
    ids = window_rows(first, _valid_steps(info), steps) if pad else first[:, None] + np.arange(steps)[None, :]
    rows = yield from rows_by_id(state, ids.reshape(-1))
    return state.schema.decode({name: rows[name].reshape(size, steps, *rows[name].shape[1:])
                                for name in state.schema.names}), info


def _valid_steps(info: SampleInfo) -> np.ndarray:
    if info.valid_steps is None or len(info.valid_steps) != len(info):
        raise ProtocolError("the server sent padded windows without valid_steps for each: it does not pad")
    return info.valid_steps


def sample_transitions(state: LearnerState, batch_size: Any, n_step: Any, gamma: Any, with_info: bool,
                       seed: int | None, table: str | None) -> Plan[Drawn]:
    """`batch_size` n-step transitions drawn by the server (see LearnerClient.sample_transitions).

    Raises:
        ConfigError: the server keeps no final observations, a bad n_step or gamma, or no such table.
    """
    n, discount_rate = check_n_step(n_step, gamma)
    size = _positive(batch_size, "batch_size")
    keys = state.transition_keys
    if keys is None:
        raise ConfigError("this server keeps no final observations: serve a file created with "
                          "--observation-keys (observation_keys=) to draw transitions")
    keys.check_sampling(state.space)
    schema = state.transition_schema(keys)
    t = state.table(table)
    per = max(1, t.rows_per_sample * state.schema.row_bytes // max(1, schema.row_bytes + P.SAMPLE_INFO_BYTES + 1))
    limit = state.config.rate_limit_timeout

    def requests(count: int) -> list[RequestFactory]:
        return [_request(P.SampleTransitions, hi - lo, n, discount_rate, _seed(seed, k), state.min_seq, limit, t.asked,
                         _skip(lo, t))
                for k, (lo, hi) in enumerate(_chunks(count, per))]

    if t.consuming:
        return (yield from consume(state, ("transitions", n, discount_rate, *t.kind), size, requests,
                                   decoded(schema, with_info)))
    yield from fresh(state)
    local = yield from local_view(state, t)
    if local is not None:
        here = drawn_here(state, local, "sample_transitions", size, per, seed, lambda count, part_seed, lo: (
            (count,), {"n_step": n, "gamma": discount_rate, "rng": _rng(state, part_seed), "table": t.asked,
                       "skip": _skip(lo, t) or 0}))
        if here is not None:
            arrays, info = here
            batch = schema.decode(arrays)
            return _ready((batch, info) if with_info else batch)
    replies = yield from read_many(state, t.samples, requests(size))
    return _ready(sampled(state, replies, with_info, schema))
