"""h5replay: an experience store for reinforcement learning over one HDF5 file."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["__version__"]
