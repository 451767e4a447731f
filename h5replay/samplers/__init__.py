"""Samplers: how a table draws from the rows it holds, one strategy per module.

`Sampler` (base.py) is what every one is; `Uniform`, `Prioritized`, `Fifo` / `Lifo`
(ordered.py), `Recency` and `Mixture` are the strategies; `SumTree` keeps the weights of those
that need them. Pure numpy: clients, the CLI and the storage use them alike.
"""

from __future__ import annotations

from h5replay.samplers.base import Rows, Sampler, kinds, sampler_from_json, sampler_from_obj, sampler_to_json
from h5replay.samplers.mixture import Mixture
from h5replay.samplers.ordered import Fifo, Lifo
from h5replay.samplers.prioritized import MAX_WEIGHT, Prioritized
from h5replay.samplers.recency import Recency
from h5replay.samplers.uniform import Uniform

__all__ = ["Sampler", "Rows", "Uniform", "Prioritized", "Fifo", "Lifo", "Recency", "Mixture", "MAX_WEIGHT", "kinds",
           "sampler_from_json", "sampler_from_obj", "sampler_to_json"]
