"""Suite-wide settings: hypothesis profiles.

"ci" (the default) is sized for a 2-core runner; "thorough" is opt-in:
``H5REPLAY_HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=500)
settings.load_profile(os.environ.get("H5REPLAY_HYPOTHESIS_PROFILE", "ci"))
