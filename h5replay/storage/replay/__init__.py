"""The replay buffer: a ring of rows in an HDF5Storage, its episodes, and the ways of sampling it.

Each module has one job: `buffer.py` the buffer: its state, publishes, reads and info; `commits.py`
its verbs that add rows (append, segment commits, idempotency, clear); `draws.py` its sampling verbs
(samples, priority updates, the counters an export carries); `journal.py` what the file publishes
and in which order; `keys.py` idempotency keys; `table.py` a way of sampling the rows (its sampler's
state, rate limit and removals); `table_file.py` a table's datasets; `sumtree.py` the sum tree.
"""

from __future__ import annotations

from h5replay.storage.replay.buffer import CommitInfo, ReplayBuffer

__all__ = ["CommitInfo", "ReplayBuffer"]
