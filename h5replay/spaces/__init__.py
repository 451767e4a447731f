"""Box / Binary / Text / Dict spaces, and the Schema of one space: what a sample looks like, how
it is checked, how a nested batch becomes one array per leaf and back, its JSON form.

Pure code (numpy only): no files, no sockets, no h5py, so clients import it cheaply. Every name is
imported from here; each module has one job: `base.py` the Space and LeafSpace contracts and
DictSpace, `leaves.py` Box / Binary / Text, `from_json.py` a space back from its JSON,
`schema.py` the Schema (and the functions it is made of), `gym.py` gymnasium spaces as these. The storage,
the server's checks of what arrives off the wire and both clients go through `Schema`, the one
implementation of flatten / validate / encode / decode. A leaf's own contract has two halves:

* ``encode_batch(value, num_rows, key)`` checks a user batch (leading axis ``num_rows``) and returns
  the array that is written to HDF5 (``storage_dtype``), or raises ``SpaceMismatchError`` naming the
  key and what was expected. Nothing is written before every leaf has been encoded.
* ``decode_batch(stored)`` turns stored rows back into what the user sees (``str`` for text).

Text is stored as fixed-length UTF-8 byte fields sized for ``max_length`` characters (4 bytes each),
because variable-length strings cannot be written under HDF5's SWMR mode.
"""

from __future__ import annotations

from h5replay.spaces.base import MAX_DEPTH, MAX_ROW_BYTES, DictSpace, LeafSpace, Space
from h5replay.spaces.from_json import space_from_json
from h5replay.spaces.gym import space_from_gymnasium
from h5replay.spaces.leaves import BinarySpace, BoxSpace, TextSpace
from h5replay.spaces.schema import DEFAULT_KEY, Schema, flatten_value, named_leaves, unflatten_value

__all__ = [
    "Space",
    "LeafSpace",
    "BoxSpace",
    "BinarySpace",
    "TextSpace",
    "DictSpace",
    "space_from_json",
    "Schema",
    "DEFAULT_KEY",
    "named_leaves",
    "flatten_value",
    "unflatten_value",
    "MAX_ROW_BYTES",
    "MAX_DEPTH",
    "space_from_gymnasium",
]
