"""The replay buffer: a ring of rows in a storage (`RowStore`: an HDF5Storage), its episodes, and
the tables that sample it.

Each module has one job: `buffer.py` the buffer: its state, publishes, reads and info; `commits.py`
its verbs that add rows (append, segment commits, idempotency, clear); `draws.py` its sampling verbs
(samples, priority updates, the counters an export carries); `rows.py` what it needs of the storage
of its rows; `ring.py` ids to slots; `state.py` the published state and its journal rows;
`episodes.py` the episode table; `journal.py` what the file publishes and in which order; `keys.py`
idempotency keys; `tables.py` what the tables agree on; `table.py` one table at run time (its
sampler's weights, priorities, removals); `table_file.py` a table's datasets. The samplers
themselves are in `h5replay.samplers`.
"""

from __future__ import annotations

from h5replay.storage.replay.buffer import CommitInfo, ReplayBuffer

__all__ = ["CommitInfo", "ReplayBuffer"]
