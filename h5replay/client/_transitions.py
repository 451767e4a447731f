"""LearnerClient.sample_transitions: n-step transitions drawn by the server (a mixin of
`LearnerClient`; the arithmetic is the buffer's, see h5replay/transitions.py)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._reads import TableDraws, _chunks, _positive, _request, _seed, sample_info
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError
from h5replay.spaces import Schema, Space
from h5replay.transitions import TransitionKeys, check_n_step, described_keys

__all__ = ["TransitionReads"]


class TransitionReads:
    """What a learner reads of transitions: `sample_transitions`, and the server's keys."""

    # What this mixin uses of LearnerClient (set in its __init__).
    config: ClientConfig
    space: Space
    schema: Schema
    sampling: dict[str, Any]
    _router: Any

    if TYPE_CHECKING:

        @property
        def _min_seq(self) -> int: ...

        def _table(self, table: str | None) -> TableDraws: ...
        def _read_many(self, factories: Sequence[Callable[[int], P.Request]]) -> list[Any]: ...
        def _joined(self, parts: list[Mapping[str, np.ndarray]], names: Sequence[str] | None = None) -> dict[str, np.ndarray]: ...
        def _consume(self, kind: Any, size: int, requests: Callable[[int], list[Callable[[int], P.Request]]],
                     with_info: bool, schema: Schema | None = None) -> Any: ...

    @property
    def transition_keys(self) -> TransitionKeys | None:
        """The server's observation keys and reward / end-flag leaves (None: it keeps no finals)."""
        if self._router is not None:
            return self._router.transition_keys  # type: ignore[no-any-return]
        return described_keys(self.space, self.sampling)

    def _transition_schema(self, keys: TransitionKeys) -> Schema:
        """The schema of a transition of this server's rows."""
        return Schema(keys.transition_space(self.space))

    def _kind_schema(self, kind: Any) -> Schema:
        """The schema of what a kept draw of `kind` holds: a transition, or the rows' own."""
        keys = self.transition_keys
        return self._transition_schema(keys) if kind[0] == "transitions" and keys is not None else self.schema

    def sample_transitions(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                           seed: int | None = None, table: str | None = None) -> Any:
        """`batch_size` n-step transitions drawn by the server (see
        `ReplayBuffer.sample_transitions`): the step's leaves with `reward` summed over the next
        `k` steps, `discount` = gamma ** k, `next` (the observation n steps on, or the episode's
        final) and the end flags of the last step summed. With `with_info=True`, (batch,
        SampleInfo) with `has_final`. Drawn in parts, kept on a failure, over shards: as `sample`.

        Raises:
            ConfigError: the server keeps no final observations (`serve --observation-keys`), a
                bad n_step or gamma, or no such table.
            NotEnoughDataError, RateLimitedError: as `sample`.
        """
        if self._router is not None:
            return self._router.sample_transitions(batch_size, n_step=n_step, gamma=gamma, with_info=with_info,
                                                   seed=seed, table=table)
        n, discount_rate = check_n_step(n_step, gamma)
        size = _positive(batch_size, "batch_size")
        keys = self.transition_keys
        if keys is None:
            raise ConfigError("this server keeps no final observations: serve a file created with "
                              "--observation-keys (observation_keys=) to draw transitions")
        keys.check_sampling(self.space)
        schema = self._transition_schema(keys)
        t = self._table(table)
        per = max(1, t.rows_per_sample * self.schema.row_bytes // max(1, schema.row_bytes + P.SAMPLE_INFO_BYTES + 1))
        limit = self.config.rate_limit_timeout

        def requests(count: int) -> list[Callable[[int], P.Request]]:
            return [_request(P.SampleTransitions, hi - lo, n, discount_rate, _seed(seed, k), self._min_seq, limit, t.asked)
                    for k, (lo, hi) in enumerate(_chunks(count, per))]

        if t.consuming:
            return self._consume(("transitions", n, discount_rate, *t.kind), size, requests, with_info, schema)
        replies = self._read_many(requests(size))
        batch = schema.decode(self._joined([r.arrays for r in replies], schema.names))
        return (batch, sample_info(replies)) if with_info else batch
