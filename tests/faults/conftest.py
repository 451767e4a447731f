"""Fixtures for tests that run a real server (see tests/service_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:  # tests/ is not a package; spawned children inherit this sys.path
    sys.path.insert(0, _TESTS)

from service_helpers import start_server  # noqa: E402,F401  (a fixture)
