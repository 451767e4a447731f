"""LearnerClient.sample_sequences: windows of consecutive steps drawn by the server, padded or not
(a mixin of `LearnerClient`; padding is h5replay/windows.py's)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._reads import TableDraws, _chunks, _positive, _request, _seed, sample_info
from h5replay.config import ClientConfig
from h5replay.errors import ProtocolError
from h5replay.records import SampleInfo
from h5replay.spaces import Schema, Space
from h5replay.windows import check_pad_space, masked, window_rows

__all__ = ["SequenceReads"]


class SequenceReads:
    """What a learner reads of windows: `sample_sequences`."""

    # What this mixin uses of LearnerClient (set in its __init__).
    config: ClientConfig
    space: Space
    schema: Schema
    limits: P.Limits
    _router: Any

    if TYPE_CHECKING:

        @property
        def _min_seq(self) -> int: ...

        def _table(self, table: str | None) -> TableDraws: ...
        def _sample_many(self, factories: Sequence[Callable[[int], P.Request]], t: TableDraws) -> list[Any]: ...
        def _sampled(self, replies: list[Any], with_info: bool) -> Any: ...
        def _rows_by_id(self, ids: np.ndarray, min_seq: int) -> dict[str, np.ndarray]: ...
        def _decode(self, arrays: Mapping[str, np.ndarray]) -> Any: ...
        def _consume(self, kind: Any, size: int, requests: Callable[[int], list[Callable[[int], P.Request]]],
                     with_info: bool, schema: Schema | None = None) -> Any: ...

    def _window_requests(self, size: int, steps: int, seed: int | None, t: TableDraws,
                         pad: bool = False) -> list[Callable[[int], P.Request]] | None:
        """The SampleSequences requests of one batch with its rows, or None when one window is
        bigger than a message (then the windows are drawn first and read by row ids)."""
        windows = t.rows_per_sample // steps
        if windows < 1:
            return None
        limit = self.config.rate_limit_timeout
        return [_request(P.SampleSequences, hi - lo, steps, _seed(seed, k), self._min_seq, True, limit, t.asked,
                         pad or None)
                for k, (lo, hi) in enumerate(_chunks(size, windows))]

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None, *, with_info: bool = False,
                         table: str | None = None, pad: bool = False) -> Any:
        """`batch_size` windows of `length` consecutive steps, each inside one complete episode;
        leaves come back shaped (batch_size, length, ...). With `with_info=True` returns
        (batch, SampleInfo) of each window's first row. `pad=True`: windows may start in an
        episode's last `length - 1` steps, zero-padded past its end, with `batch["mask"]` of the
        valid steps (see `ReplayBuffer.sample_sequences`). `table` and over several servers, as
        `sample`."""
        if self._router is not None:
            return self._router.sample_sequences(batch_size, length, seed, with_info=with_info, table=table, pad=pad)
        size, steps = _positive(batch_size, "batch_size"), _positive(length, "length")
        if pad:
            check_pad_space(self.space)
        t = self._table(table)
        requests = self._window_requests(size, steps, seed, t, pad)
        if requests is not None and t.consuming:  # a rate limit counts them: kept on a failure, as `sample`
            kind = ("padded windows" if pad else "windows", steps, *t.kind)
            drawn = self._consume(kind, size, lambda n: self._window_requests(n, steps, seed, t, pad) or [], True)
        elif requests is not None:
            drawn = self._sampled(self._sample_many(requests, t), True)
        else:
            drawn = self._by_row_ids(size, steps, seed, t, pad)
        batch, info = drawn
        if pad:
            batch = masked(batch, _valid_steps(info), steps)
        return (batch, info) if with_info else batch

    def _by_row_ids(self, size: int, steps: int, seed: int | None, t: TableDraws, pad: bool) -> tuple[Any, SampleInfo]:
        """Windows bigger than a message: drawn first, then each read by row ids (a padded one
        up to its episode's last row)."""
        limit = self.config.rate_limit_timeout
        replies = self._sample_many([
            _request(P.SampleSequences, hi - lo, steps, _seed(seed, k), self._min_seq, False, limit, t.asked, pad or None)
            for k, (lo, hi) in enumerate(_chunks(size, self.limits.max_rows_per_message))
        ], t)
        info = sample_info(replies)
        first = info.row_ids.astype(np.int64)
        ids = window_rows(first, _valid_steps(info), steps) if pad else first[:, None] + np.arange(steps)[None, :]
        rows = self._rows_by_id(ids.reshape(-1), self._min_seq)
        return self._decode({name: rows[name].reshape(size, steps, *rows[name].shape[1:])
                             for name in self.schema.names}), info


def _valid_steps(info: SampleInfo) -> np.ndarray:
    if info.valid_steps is None or len(info.valid_steps) != len(info):
        raise ProtocolError("the server sent padded windows without valid_steps for each: it does not pad")
    return info.valid_steps
