"""gymnasium spaces as h5replay spaces (`space_from_gymnasium`).

gymnasium is not a dependency: only the objects' attributes are read, so this module imports
nothing of gymnasium and works with any object shaped like its spaces. The conversion itself lives
with the spaces (h5replay.spaces.gym), which the storage re-exports too: an integration sits above
the storage and the server, never below them.
"""

from __future__ import annotations

from h5replay.spaces.gym import space_from_gymnasium

__all__ = ["space_from_gymnasium"]
