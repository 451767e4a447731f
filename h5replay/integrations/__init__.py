"""Bridges to other libraries, each in its own module and each optional:

* `h5replay.integrations.gym`: `space_from_gymnasium`, a gymnasium space as an h5replay space
  (reads the objects' attributes only: gymnasium itself is needed only to make them).
* `h5replay.integrations.torch`: `H5ReplayDataset`, an `IterableDataset` of sampled batches for a
  PyTorch `DataLoader` (`pip install 'h5replay[torch]'`).
* `h5replay.integrations.ray`: `start_shards`, h5replay servers placed on a Ray cluster, one per
  node, restarted on their node (`pip install 'h5replay[ray]'`).

Nothing is imported here, so `import h5replay.integrations` never needs those libraries.
"""

from __future__ import annotations

__all__: list[str] = []
