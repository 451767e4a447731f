"""Suite-wide settings: hypothesis profiles, the `start_server`, `actor_of` and `learner_of` fixtures, opt-in soak tests.

tests/ is on sys.path through pytest's `pythonpath` setting (pyproject.toml), so test modules and
the processes they spawn (which inherit sys.path) import the helper modules beside this file:
service_helpers, fault_helpers, memory_backend.

Hypothesis: "ci" (the default) is sized for a 2-core runner; "thorough" is opt-in:
``H5REPLAY_HYPOTHESIS_PROFILE=thorough pytest``.
"""

from __future__ import annotations

import os

import pytest
from client_fronts import actor_of, fronts, learner_of  # noqa: F401  (clients of each driver, blocking and asyncio)
from hypothesis import HealthCheck, settings
from service_helpers import start_server  # noqa: F401  (a fixture for every test that runs a server)

settings.register_profile(
    "ci", max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=500)
settings.load_profile(os.environ.get("H5REPLAY_HYPOTHESIS_PROFILE", "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Soak tests run only with `-m soak` or H5REPLAY_SOAK=1, never in a plain `pytest`."""
    if "soak" in (config.getoption("markexpr") or "") or os.environ.get("H5REPLAY_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="soak test: run with -m soak or H5REPLAY_SOAK=1")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)
