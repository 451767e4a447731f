"""PyTorch: `H5ReplayDataset`, an `IterableDataset` of batches sampled from an h5replay server.

Each item is one whole batch (dicts of tensors nested like the space), so give the DataLoader
``batch_size=None``. The dataset holds only settings: it pickles to worker processes, and each
worker opens its own LearnerClient when it starts iterating (sockets are never inherited or
pickled). A background thread per iterator samples ahead into a bounded queue, so the next
batch is usually waiting when the training step asks for it; it stops, and closes its client,
when the iterator is exhausted, closed or garbage-collected.

Needs PyTorch (`pip install 'h5replay[torch]'`); the rest of h5replay never imports this module.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

try:
    import torch
    from torch.utils.data import IterableDataset, get_worker_info
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("h5replay.integrations.torch needs PyTorch: pip install 'h5replay[torch]'") from exc

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.integrations._tensors import to_tensors
from h5replay.sampling import check_table_name
from h5replay.transitions import check_n_step

__all__ = ["H5ReplayDataset", "to_tensors"]  # and H5ReplayMapDataset, on use (__getattr__)

_POLL = 0.1  # seconds between checks of the stop flag while a queue is full or empty


class _End:
    """Put on the queue last: the producer finished (normally, or with `error`)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error


class H5ReplayDataset(IterableDataset[Any]):  # type: ignore[misc,unused-ignore]  # Any without torch installed
    """Batches sampled from a server, for `DataLoader(dataset, batch_size=None, num_workers=...)`.

    Args:
        endpoint: the server's (writer's) endpoint, e.g. "tcp://127.0.0.1:5555".
        batch_size: rows per batch (windows per batch with `sequence_length`).
        sequence_length: sample windows of this many consecutive steps of one episode (leaves
            shaped (batch_size, sequence_length, ...)) instead of single rows.
        num_batches: batches per pass over the dataset, shared out among the DataLoader's
            workers; None samples forever.
        prefetch: batches each iterator samples ahead (the bounded queue's size).
        timeout: seconds a request may wait for the server; also how long an empty buffer (or
            one with no episode long enough for `sequence_length`) is waited for before
            NotEnoughDataError.
        secret_key, server_key: CURVE certificate files for a server started with --auth.
        table: the table to sample (None: the server's only table).
        transitions: sample n-step transitions (`LearnerClient.sample_transitions`: the step's
            leaves, `next`, `discount`, the summed `reward`) instead of rows; needs a server
            with observation keys. `n_step`, `gamma`: theirs.
        with_info: each item is (batch, SampleInfo): the rows' ids and the probabilities they
            were drawn with, for prioritized replay through a DataLoader
            (`info.importance_weights(beta)`, then `dataset.update_priorities(info.packed_row_ids,
            new)`). A batch sampled ahead was drawn before the updates of the batches just
            before it (by at most `prefetch` batches per worker).

    `update_priorities` and `close` act from the process that calls them (the training loop),
    through a client of their own, never a worker's.
    """

    def __init__(
        self,
        endpoint: str,
        batch_size: int,
        *,
        sequence_length: int | None = None,
        num_batches: int | None = None,
        prefetch: int = 2,
        timeout: float = 30.0,
        secret_key: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
        table: str | None = None,
        transitions: bool = False,
        n_step: int = 1,
        gamma: float = 0.99,
        with_info: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        if sequence_length is not None and sequence_length < 1:
            raise ConfigError(f"sequence_length must be >= 1 or None, got {sequence_length}")
        if num_batches is not None and num_batches < 0:
            raise ConfigError(f"num_batches must be >= 0 or None (forever), got {num_batches}")
        if prefetch < 1:
            raise ConfigError(f"prefetch must be >= 1, got {prefetch}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.endpoint = endpoint
        self.batch_size = batch_size
        self.sequence_length = sequence_length
        self.num_batches = num_batches
        self.prefetch = prefetch
        self.timeout = timeout
        self.secret_key = secret_key
        self.server_key = server_key
        self.table = None if table is None else check_table_name(table)
        if transitions and sequence_length is not None:
            raise ConfigError("give transitions=True or sequence_length, not both")
        self.transitions = bool(transitions)
        self.n_step, self.gamma = check_n_step(n_step, gamma)
        self.with_info = bool(with_info)
        self._priorities: Any = None  # this process's client for update_priorities, opened on first use

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: a worker never inherits the training loop's client."""
        return {key: value for key, value in self.__dict__.items() if key != "_priorities"} | {"_priorities": None}

    def update_priorities(self, row_ids: Any, priorities: Any, *, wait: bool = True) -> int | None:
        """Set the priorities of sampled rows (`info.packed_row_ids` of a `with_info` batch;
        tensors or arrays) in the dataset's table, as `LearnerClient.update_priorities` does
        (its return value, `wait=False` and errors)."""
        if self._priorities is None:
            from h5replay.client import LearnerClient

            self._priorities = LearnerClient(self.endpoint, timeout=self.timeout, name=f"torch-priorities-{os.getpid()}",
                                             secret_key=self.secret_key, server_key=self.server_key)
        ids = row_ids.numpy(force=True) if isinstance(row_ids, torch.Tensor) else np.asarray(row_ids)
        values = priorities.numpy(force=True) if isinstance(priorities, torch.Tensor) else np.asarray(priorities)
        updated: int | None = self._priorities.update_priorities(ids, values, wait=wait, table=self.table)
        return updated

    def close(self) -> None:
        """Close the client `update_priorities` opened (the sampling threads close their own)."""
        if self._priorities is not None:
            self._priorities.close()
            self._priorities = None

    def __len__(self) -> int:
        """`num_batches`; a dataset that samples forever has no length (TypeError)."""
        if self.num_batches is None:
            raise TypeError("an H5ReplayDataset without num_batches samples forever and has no length")
        return self.num_batches

    def _share(self) -> tuple[int | None, str]:
        """This worker's number of batches and client name."""
        worker = get_worker_info()
        if worker is None:
            return self.num_batches, f"torch-{os.getpid()}"
        name = f"torch-worker-{worker.id}-{os.getpid()}"
        if self.num_batches is None:
            return None, name
        share, extra = divmod(self.num_batches, worker.num_workers)
        return share + (1 if worker.id < extra else 0), name

    def __iter__(self) -> Iterator[Any]:
        """Batches as tensors. Blocks while the next batch is being sampled; raises what the
        sampling thread raised (ServerUnavailableError, NotEnoughDataError, ...)."""
        count, name = self._share()
        if count == 0:
            return
        batches: queue.Queue[Any] = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=self._produce, args=(count, name, batches, stop), name=f"h5replay-{name}", daemon=True
        )
        thread.start()
        try:
            while True:
                try:
                    item = batches.get(timeout=_POLL)
                except queue.Empty:
                    if not thread.is_alive() and batches.empty():
                        raise RuntimeError("the h5replay sampling thread ended without a word") from None
                    continue
                if isinstance(item, _End):
                    if item.error is not None:
                        raise item.error
                    return
                yield item
        finally:
            stop.set()
            while thread.is_alive():  # unblock a producer waiting on a full queue
                try:
                    batches.get_nowait()
                except queue.Empty:
                    pass
                thread.join(_POLL)

    def _draws(self, client: Any) -> Iterator[Any]:
        """Batches without end from `client`: transitions, or rows / windows drawn ahead."""
        if self.transitions:
            return _transitions(self, client)
        batches: Iterator[Any] = client.batches(self.batch_size, prefetch=self.prefetch, with_info=self.with_info,
                                                sequence_length=self.sequence_length, table=self.table)
        return batches

    def _item(self, drawn: Any) -> Any:
        """What the DataLoader yields of a draw: the batch as tensors, with its SampleInfo."""
        if self.with_info:
            batch, info = drawn
            return to_tensors(batch), info
        return to_tensors(drawn)

    def _produce(self, count: int | None, name: str, batches: queue.Queue[Any], stop: threading.Event) -> None:
        """The sampling thread: owns the client (made here, closed here) and fills the queue."""
        from h5replay.client import LearnerClient

        end = _End()
        try:
            with LearnerClient(self.endpoint, timeout=self.timeout, name=name,
                               secret_key=self.secret_key, server_key=self.server_key) as client:
                produced = 0
                empty_since: float | None = None
                while not stop.is_set() and (count is None or produced < count):
                    try:
                        for batch in self._draws(client):
                            empty_since = None
                            _put(batches, self._item(batch), stop)
                            produced += 1
                            if stop.is_set() or (count is not None and produced >= count):
                                break
                    except NotEnoughDataError:
                        empty_since = empty_since or time.monotonic()
                        if time.monotonic() - empty_since > self.timeout:
                            raise
                        stop.wait(_POLL)
        except BaseException as exc:  # handed to the consumer, who raises it
            end = _End(exc)
        _put(batches, end, stop)


def _transitions(dataset: H5ReplayDataset, client: Any) -> Iterator[Any]:
    while True:
        yield client.sample_transitions(dataset.batch_size, n_step=dataset.n_step, gamma=dataset.gamma,
                                        with_info=dataset.with_info, table=dataset.table)


def _put(batches: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    """Put `item` on the bounded queue, waiting for room until the consumer stops."""
    while not stop.is_set():
        try:
            batches.put(item, timeout=_POLL)
            return
        except queue.Full:
            continue


def __getattr__(name: str) -> Any:
    """`H5ReplayMapDataset` (torch_map.py), imported on use."""
    if name == "H5ReplayMapDataset":
        from h5replay.integrations.torch_map import H5ReplayMapDataset

        return H5ReplayMapDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
