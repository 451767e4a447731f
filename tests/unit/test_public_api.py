"""The public names users' code is written against: changing them is a deliberate act."""

from __future__ import annotations

import h5replay
import h5replay.client
import h5replay.errors
import h5replay.server
import h5replay.storage
import h5replay.storage.indexing


def test_public_names_are_pinned():
    assert h5replay.__all__ == ["__version__"]
    assert sorted(h5replay.client.__all__) == [
        "ActorClient", "ActorSegment", "Episode", "InDoubt", "LearnerClient", "PendingCommit", "Receipt", "SampleInfo",
        "View", "pack_ids", "unpack_ids",
    ]
    assert sorted(h5replay.server.__all__) == ["Server", "ServerProcess"]
    assert set(h5replay.storage.__all__) >= {
        "BoxSpace", "BinarySpace", "TextSpace", "DictSpace", "HDF5Storage", "ReplayBuffer", "SegmentWriter",
        "CHUNK_TARGET_BYTES", "is_fancy_index", "fancy_indexing_to_supported_indexing",
        "fancy_indexing_to_supported_set_indexing", "io_reduced_indexing", "read_sorted_unique_rows",
        "write_rows", "write_sorted_unique_rows", "space_from_json", "space_from_gymnasium",
        "SampleInfo", "Episode", "Receipt", "export_file", "compact_file", "export_buffer",
    }
    assert h5replay.client.SampleInfo is h5replay.storage.SampleInfo
    for name in ("EvictedError",):
        assert name in h5replay.errors.__all__
    assert issubclass(h5replay.errors.EvictedError, IndexError)
    assert h5replay.storage.CHUNK_TARGET_BYTES == 64 * 1024
    for name in ("H5ReplayError", "SpaceMismatchError", "ReadOnlyError", "ServerUnavailableError"):
        assert name in h5replay.errors.__all__
    assert issubclass(h5replay.errors.SpaceMismatchError, ValueError)
    assert issubclass(h5replay.errors.ServerUnavailableError, TimeoutError)
    for name in h5replay.storage.indexing.__all__ if hasattr(h5replay.storage.indexing, "__all__") else []:
        assert hasattr(h5replay.storage.indexing, name)


def test_clients_import_neither_h5py_nor_the_storage():
    """Every actor and DataLoader worker imports h5replay.client: it must stay light (no h5py)."""
    import subprocess
    import sys

    code = "import sys, h5replay.client; print('h5py' in sys.modules, 'h5replay.storage' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["False", "False"], done.stderr


def test_one_schema_serves_storage_wire_and_clients():
    from h5replay.spaces import Schema

    assert h5replay.storage.Schema is Schema and "Schema" in h5replay.storage.__all__
