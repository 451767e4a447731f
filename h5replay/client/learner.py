"""LearnerClient: read rows and sample batches from an h5replay server.

The hello goes to the writer's endpoint, which names the read endpoint served by reader
processes; gets and samples go there, so learners never slow down ingest. Logical index 0 is
the oldest row held when the request is served: the ring moves as actors commit, so indices
from one call address the buffer as it was at that call.

Returned arrays are read-only views of the received message (no copy); copy them to modify.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from h5replay import protocol as P
from h5replay.client._connection import Connection, curve_keys, say_hello
from h5replay.config import DEFAULT_ENDPOINT, ClientConfig
from h5replay.errors import ProtocolError
from h5replay.storage.spaces import (
    Space,
    named_leaves,
    space_from_json,
    unflatten_value,
)

__all__ = ["LearnerClient"]

_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")


def _reachable(advertised: str, dialed: str) -> str:
    """The read endpoint to dial: a wildcard host (a server bound on 0.0.0.0) becomes the host this
    client reached the writer on."""
    if advertised.startswith("tcp://") and dialed.startswith("tcp://"):
        host, _, port = advertised[len("tcp://"):].rpartition(":")
        if host in _WILDCARD_HOSTS:
            return f"tcp://{dialed[len('tcp://'):].rpartition(':')[0]}:{port}"
    return advertised


class LearnerClient:
    """Reads from a server. Calls are serialised by a lock; one per thread is fastest.

    Args:
        endpoint: the server's (writer's) endpoint, e.g. "tcp://127.0.0.1:5555".
        timeout: seconds to wait for any reply before raising ServerUnavailableError.
        config: full client settings (overrides endpoint and timeout).
        secret_key, server_key: CURVE certificate files (`h5replay keys generate`).

    Raises:
        ServerUnavailableError: the server did not answer the hello within `timeout`.
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        timeout: float = 10.0,
        *,
        name: str | None = None,
        config: ClientConfig | None = None,
        secret_key: str | os.PathLike[str] | None = None,
        server_key: str | os.PathLike[str] | None = None,
    ) -> None:
        self.config = config or ClientConfig(endpoint=endpoint, timeout=timeout, name=name or f"learner-{os.getpid()}")
        curve = curve_keys(secret_key, server_key)
        self._conn, hello = say_hello(self.config, "learner", curve)
        self._reads: Connection | None = None
        try:
            read_endpoint = _reachable(hello.read_endpoint, self.config.endpoint)
            if read_endpoint == self.config.endpoint:
                self._reads = self._conn
            else:
                self._reads = Connection(read_endpoint, self.config, curve=curve)
                self._reads.limits = hello.limits
        except BaseException:
            self.close()
            raise
        self.limits = hello.limits
        self.space: Space = space_from_json(hello.space)
        self.capacity: int | None = hello.capacity
        self.read_endpoint = _reachable(hello.read_endpoint, self.config.endpoint)
        self.server_version = hello.server_version
        self._leaves = named_leaves(self.space)

    # ------------------------------------------------------------------ figures

    def info(self) -> dict[str, Any]:
        """The server's figures: length, capacity, num_episodes, clients, rows_in, rows_out, ..."""
        return dict(self._conn.request(lambda rid: P.Info(rid)).stats)  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return int(self.info()["length"])

    # ------------------------------------------------------------------ reads

    def _decode(self, arrays: Mapping[str, np.ndarray]) -> Any:
        return unflatten_value(self.space, {path: leaf.decode_batch(arrays[path]) for path, leaf in self._leaves})

    def _read(self, factory: Any) -> Any:
        if self._reads is None:
            raise ProtocolError("this learner has no read connection")
        return self._reads.request(factory)

    def get(self, indices: Any) -> Any:
        """Rows at logical `indices` (ints, negatives from the end, any order, duplicates kept).

        Raises:
            IndexError: an index is out of range for the buffer as it is now.
        """
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        reply = self._read(lambda rid: P.Get(rid, idx))
        return self._decode(reply.arrays)

    def sample(self, batch_size: int, seed: int | None = None) -> Any:
        """`batch_size` rows drawn uniformly with replacement from all rows held."""
        return self.sample_with_indices(batch_size, seed)[1]

    def sample_with_indices(self, batch_size: int, seed: int | None = None) -> tuple[np.ndarray, Any]:
        """(logical indices, batch) for `sample`."""
        reply = self._read(lambda rid: P.Sample(rid, int(batch_size), seed))
        return reply.indices, self._decode(reply.arrays)

    def sample_sequences(self, batch_size: int, length: int, seed: int | None = None) -> Any:
        """`batch_size` windows of `length` consecutive steps, each inside one episode; leaves come
        back shaped (batch_size, length, ...)."""
        reply = self._read(lambda rid: P.SampleSequences(rid, int(batch_size), int(length), seed))
        return self._decode(reply.arrays)

    def get_segments(self) -> list[tuple[int, int]]:
        """(logical start, length) of every complete episode held, oldest first."""
        reply = self._read(lambda rid: P.Segments(rid))
        return [(int(s), int(n)) for s, n in reply.segments]

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Close both sockets. Safe to call twice."""
        if self._reads is not None and self._reads is not self._conn:
            self._reads.close()
        self._conn.close()

    def __enter__(self) -> LearnerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
