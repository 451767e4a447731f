"""Bridges to other libraries, each in its own module and each optional:

* `h5replay.integrations.gym`: gymnasium spaces both ways (`space_from_gymnasium`,
  `space_to_gymnasium`) and `RecordEpisodes(env, actor)`, which commits each episode of an env or
  vector env with its final observation (`pip install 'h5replay[gym]'`).
* `h5replay.integrations.torch`: `H5ReplayDataset`, an `IterableDataset` of batches sampled by a
  server, and `H5ReplayMapDataset`, a map-style dataset of a local file, for a PyTorch
  `DataLoader` (`pip install 'h5replay[torch]'`).
* `h5replay.integrations.sb3`: `H5ReplayBuffer`, Stable-Baselines3's `ReplayBuffer` in an
  h5replay file or server (`pip install 'h5replay[sb3]'`).
* `h5replay.integrations.torchrl`: `H5ReplayStorage`, a TorchRL replay-buffer storage in an
  h5replay file or server (`pip install 'h5replay[torchrl]'`).
* `h5replay.integrations.minari`: `to_minari` / `from_minari`, Minari datasets to and from a
  replay file, streaming (`pip install 'h5replay[minari]'`).
* `h5replay.integrations.lerobot`: `to_lerobot` / `from_lerobot`, LeRobot v3.0 datasets to and
  from a replay file (`pip install 'h5replay[lerobot]'`).
* `h5replay.integrations.ray`: `start_shards`, h5replay servers placed on a Ray cluster, one per
  node, restarted on their node (`pip install 'h5replay[ray]'`).

Nothing is imported here, so `import h5replay.integrations` never needs those libraries.
"""

from __future__ import annotations

__all__: list[str] = []
