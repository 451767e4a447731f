"""What a learner knows of its server: limits and message sizes, its tables, the monotonic view,
the rows consuming draws handed to it that no call returned yet.

Built from the hello reply; changed only by the plans' folds (`observe`, `observe_stats`) and by
the kept rows. Pure: no socket, no lock, no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._core.ops import READS, WRITER
from h5replay.client._kept import Kept
from h5replay.client._local import LocalRows
from h5replay.client._reads import TableDraws, View, table_draws
from h5replay.codecs import PackedRows, decode_rows
from h5replay.config import ClientConfig
from h5replay.errors import ProtocolError
from h5replay.spaces import Schema, Space, space_from_json
from h5replay.transitions import TransitionKeys, described_keys

__all__ = ["LearnerState"]


def _ids_for(row_ids: Any, lead: tuple[int, ...]) -> np.ndarray | None:
    """The row id of each record of a reply's leaf of leading shape `lead` (windows: their first
    row's id and the steps after it), or None when the reply does not say."""
    if row_ids is None:
        return None
    ids = np.asarray(row_ids).astype(np.int64).reshape(-1)
    if len(lead) == 2 and ids.shape[0] == lead[0]:
        return (ids[:, None] + np.arange(lead[1], dtype=np.int64)[None, :]).reshape(-1)
    return ids if ids.shape[0] == int(np.prod(lead)) else None


class LearnerState:
    """One learner's knowledge of one server (from its `hello`), shared by every plan of it.

    Args:
        config: the client's settings (timeouts, max_in_flight, rate_limit_timeout).
        hello: the server's hello reply.
        separate_reads: whether reads go to reader processes on a socket of their own (when not,
            the `reads` target is the writer's socket too).
    """

    def __init__(self, config: ClientConfig, hello: P.HelloReply, *, separate_reads: bool = True) -> None:
        self.config = config
        self.limits = hello.limits
        self.space: Space = space_from_json(hello.space)
        self.capacity = hello.capacity
        self.sampling: dict[str, Any] = dict(hello.sampling)
        self.separate_reads = separate_reads
        self.schema = Schema(self.space)
        room = self.limits.max_message_bytes - P.ROWS_MESSAGE_OVERHEAD
        #: Rows one reply may carry, with their ids and probabilities: a bigger read is split (a
        #: single row bigger than a message is refused).
        self.rows_per_message = max(1, min(self.limits.max_rows_per_message,
                                           room // (self.schema.row_bytes + P.SAMPLE_INFO_BYTES)))
        #: A request naming rows carries their ids: it must fit a message too.
        self.ids_per_message = max(1, min(self.rows_per_message, room // P.ID_BYTES))
        #: Complete episodes one page of `episodes` asks for.
        self.episodes_per_page = max(1, min(self.limits.max_rows_per_message, room // (3 * P.ID_BYTES)))
        # A priority update's reply waits for the publish carrying it: up to the server's interval.
        interval = hello.sampling.get("priority_publish_interval", 0.0)
        valid = isinstance(interval, (int, float)) and not isinstance(interval, bool) and 0 <= interval <= 1
        self.update_timeout = config.timeout + (float(interval) if valid else 1.0)
        self.view: View | None = None
        self.kept = Kept()
        #: The newest publish this client's own priority updates (waited for) made.
        self.seen_seq = 0
        # Set by a driver that holds priority updates back (wait=False): whether some are held or
        # travel (a read first flushes them), and the newest publish their replies named.
        self.updates_pending: Callable[[], bool] = lambda: False
        self.updates_seq: Callable[[], int] = lambda: 0
        self._tables: dict[str | None, TableDraws] = {}
        self._leaf_of = dict(self.schema.leaves)
        #: This process's own view of the server's file, when it is on the file's host (ClientConfig.local_reads).
        self.local = LocalRows.of(hello, config.local_reads)
        self.rng = np.random.default_rng()  # draws from that view without a seed

    # ------------------------------------------------------------------ tables

    def table(self, table: str | None) -> TableDraws:
        """How to draw from `table` (None: the server's only table).

        Raises:
            ConfigError: the server has no such table, or several and none was named.
        """
        found = self._tables.get(table)
        if found is None:
            found = self._tables[table] = table_draws(self.sampling, table, WRITER, READS, self.rows_per_message)
        return found

    def close(self) -> None:
        """Let go of what this state holds open (its view of the file). Safe twice."""
        if self.local is not None:
            self.local.close()

    def reads_locally(self, t: TableDraws) -> bool:
        """Whether draws from `t` are made from this client's own view of the file: on the file's
        host, from a table whose draws change nothing on the server (readers may make them)."""
        return self.local is not None and self.local.usable and not t.consuming and t.samples == READS

    def table_figure(self, t: TableDraws, figure: str) -> Any:
        return self.sampling.get(f"table.{t.name}.{figure}", self.sampling.get(figure))

    def draw_timeout(self, t: TableDraws) -> float | None:
        """How long to wait for a sample's reply: the client's timeout from readers; plus the rate
        limit's hold from the writer (None: the client's)."""
        if t.samples == READS:
            return None
        return self.config.timeout + self.config.rate_limit_timeout

    @property
    def transition_keys(self) -> TransitionKeys | None:
        """The server's observation keys and reward / end-flag leaves (None: it keeps no finals)."""
        return described_keys(self.space, self.sampling)

    def transition_schema(self, keys: TransitionKeys) -> Schema:
        return Schema(keys.transition_space(self.space))

    def kind_schema(self, kind: Any) -> Schema:
        """The schema of what a kept draw of `kind` holds: a transition, or the rows' own."""
        keys = self.transition_keys
        return self.transition_schema(keys) if kind[0] == "transitions" and keys is not None else self.schema

    # ------------------------------------------------------------------ rows of a reply

    @property
    def packed(self) -> bool | None:
        """What read requests say of compressed leaves: True, send them as stored (this client
        decodes them); None, decode them on the server (ClientConfig.raw_rows)."""
        return None if self.config.raw_rows else True

    def rows_of(self, reply: Any, row_ids: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The leaves of a read reply, compressed ones decoded (checked against their CRC; a
        damaged record raises DamagedRecordError naming its row: `row_ids`, else the reply's)."""
        arrays: Mapping[str, Any] = reply.arrays
        if not any(isinstance(a, PackedRows) for a in arrays.values()):
            return dict(arrays)
        if row_ids is None:
            row_ids = getattr(reply, "row_ids", None)
        out: dict[str, np.ndarray] = {}
        for path, value in arrays.items():
            if not isinstance(value, PackedRows):
                out[path] = value
                continue
            leaf = self._leaf_of.get(path)
            if leaf is None:
                raise ProtocolError(f"the server sent compressed rows of {path!r}, which is no leaf of its space")
            ids = _ids_for(row_ids, value.shape)
            out[path] = decode_rows(value, leaf.storage_dtype, leaf.shape, path, ids)
        return out

    # ------------------------------------------------------------------ the view

    @property
    def min_seq(self) -> int:
        """The publish every read asks for at least: the newest this client saw (a reader never
        answers from an older one, so the view never goes back in time)."""
        return max(self.view.seq if self.view is not None else 0, self.seen_seq, self.updates_seq())

    def observe(self, reply: P.ReadReply) -> View:
        """The view `reply` came from; this client's view moves to it unless it is older."""
        view = View(reply.seq, reply.generation, reply.begin, reply.end)
        self.observe_view(view)
        return view

    def observe_view(self, view: View) -> None:
        """A view this client read in (a reply came from, or it drew from the file in itself); its
        view moves to it unless it is older."""
        if self.view is None or view.seq >= self.view.seq:
            self.view = view

    def observe_stats(self, stats: Mapping[str, Any]) -> None:
        """The view an info reply's figures describe (seq, oldest_row_id, length, generation)."""
        seq = stats.get("seq")
        if isinstance(seq, int) and (self.view is None or seq >= self.view.seq):
            begin = int(stats.get("oldest_row_id", 0) or 0)
            self.view = View(seq, int(stats.get("generation", 0) or 0), begin,
                             begin + int(stats.get("length", 0) or 0))
