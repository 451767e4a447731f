"""The Makefile's installs are quiet and reproducible: every pip install into a venv goes
through $(PIP) (PYTHONWARNINGS=ignore, so setuptools' notice box about the compat editable mode
does not show) or the LeRobot venv's own pip with the same setting, and `make demo` installs
only the package and its runtime dependencies."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

MAKEFILE = (Path(__file__).resolve().parents[2] / "Makefile").read_text()


def test_every_pip_install_hides_setuptools_notices() -> None:
    installs = [line.strip() for line in MAKEFILE.splitlines() if "pip install" in line and not line.lstrip().startswith("#")]
    assert installs
    loud = [line for line in installs if not (line.startswith("$(PIP) install") or line.startswith("PYTHONWARNINGS=ignore"))]
    assert not loud, loud


def test_make_demo_installs_only_the_runtime_dependencies_and_says_so() -> None:
    rule = re.search(r"^\$\(DEMO_STAMP\):.*?(?=^\S)", MAKEFILE, re.M | re.S)
    assert rule is not None
    body = rule.group(0)
    assert "install --quiet -e . $(EDITABLE)" in body and "[dev" not in body
    assert "@echo \"Installing h5replay and numpy, h5py, pyzmq, msgpack" in body
    assert re.search(r"^demo: \$\(DEMO_STAMP\)$", MAKEFILE, re.M)
