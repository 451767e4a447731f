"""The replay buffer: a ring of rows in an HDF5Storage, its episodes, and the ways of sampling it.

Each module has one job: `buffer.py` the buffer's verbs; `journal.py` what the file publishes and
in which order; `keys.py` idempotency keys; `table.py` a way of sampling the rows (its sampler's
state, rate limit and removals); `table_file.py` a table's datasets; `sumtree.py` the sum tree.
"""

from __future__ import annotations

from h5replay.storage.replay.buffer import CommitInfo, ReplayBuffer

__all__ = ["CommitInfo", "ReplayBuffer"]
