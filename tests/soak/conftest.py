"""Soak tests are opt-in: they run only with `-m soak` or H5REPLAY_SOAK=1, never in a plain `pytest`."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:  # tests/ is not a package; spawned children inherit this sys.path
    sys.path.insert(0, _TESTS)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "soak" in (config.getoption("markexpr") or "") or os.environ.get("H5REPLAY_SOAK") == "1":
        return
    skip = pytest.mark.skip(reason="soak test: run with -m soak or H5REPLAY_SOAK=1")
    for item in items:
        if item.get_closest_marker("soak") is not None:
            item.add_marker(skip)
