"""Storage: HDF5Storage (one dataset per leaf), streaming segment writers, ReplayBuffer.

The spaces (h5replay.spaces, space_from_gymnasium included) and the sampling settings
(h5replay.sampling: Table, RateLimit and the samplers: Sampler, Uniform, Prioritized, Fifo, Lifo,
Recency, Mixture) are re-exported here, so
`from h5replay.storage import BoxSpace, Prioritized, ReplayBuffer` stays the one import a user needs.
"""

from __future__ import annotations

from h5replay.records import Episode, Receipt, SampleInfo
from h5replay.sampling import Fifo, Lifo, Mixture, Prioritized, RateLimit, Recency, Sampler, Table, Uniform
from h5replay.spaces import (
    BinarySpace,
    BoxSpace,
    DictSpace,
    Schema,
    Space,
    TextSpace,
    space_from_gymnasium,
    space_from_json,
)
from h5replay.storage.export import compact_file, export_buffer, export_file
from h5replay.storage.hdf5 import FORMAT_VERSION, HDF5Storage
from h5replay.storage.indexing import (
    CHUNK_TARGET_BYTES,
    fancy_indexing_to_supported_indexing,
    fancy_indexing_to_supported_set_indexing,
    io_reduced_indexing,
    is_fancy_index,
    read_sorted_unique_rows,
    write_rows,
    write_sorted_unique_rows,
)
from h5replay.storage.replay.buffer import CommitInfo, ReplayBuffer
from h5replay.storage.segment import SegmentWriter

# The design document's HDF5Storage opens a plain h5py file as a ReplayBuffer. The buffer sits on
# the storage, so hdf5.py cannot name it without an import cycle: the package, above both, adds it.
HDF5Storage.load_replay_buffer_from_raw_hdf5 = staticmethod(ReplayBuffer.from_raw_hdf5)  # type: ignore[attr-defined]

__all__ = [
    "BinarySpace",
    "BoxSpace",
    "CHUNK_TARGET_BYTES",
    "CommitInfo",
    "DictSpace",
    "Episode",
    "Fifo",
    "FORMAT_VERSION",
    "HDF5Storage",
    "Lifo",
    "Mixture",
    "Prioritized",
    "RateLimit",
    "Recency",
    "Receipt",
    "ReplayBuffer",
    "SampleInfo",
    "Sampler",
    "Schema",
    "SegmentWriter",
    "Space",
    "Table",
    "TextSpace",
    "Uniform",
    "compact_file",
    "export_buffer",
    "export_file",
    "fancy_indexing_to_supported_indexing",
    "fancy_indexing_to_supported_set_indexing",
    "io_reduced_indexing",
    "is_fancy_index",
    "read_sorted_unique_rows",
    "space_from_gymnasium",
    "space_from_json",
    "write_rows",
    "write_sorted_unique_rows",
]
