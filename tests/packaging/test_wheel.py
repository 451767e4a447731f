"""The package as a user installs it: `python -m build` gives a wheel and an sdist that `twine
check` passes, and the wheel, installed into a fresh virtual environment with its dependencies
from the package registry, runs `h5replay demo` and imports without the checkout on its path.

Marked `packaging` (it builds and installs, about a minute): `make test-wheel` runs it, in CI."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_wheel_installs_into_a_fresh_venv_and_runs_the_demo(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--outdir", dist, ROOT, cwd=tmp_path)
    wheels, sdists = sorted(dist.glob("h5replay-*.whl")), sorted(dist.glob("h5replay-*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    run(sys.executable, "-m", "twine", "check", "--strict", wheels[0], sdists[0], cwd=tmp_path)

    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=True)
    python = fresh / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", wheels[0], cwd=tmp_path)
    work = tmp_path / "elsewhere"  # not the checkout: the installed package alone
    work.mkdir()
    where = run(python, "-c", "import h5replay, importlib.metadata as m; print(h5replay.__file__); "
                "print(h5replay.__version__, m.version('h5replay'))", cwd=work).stdout.split()
    assert str(fresh) in where[0] and where[1] == where[2], where
    installed = run(python, "-m", "pip", "list", "--format=freeze", cwd=work).stdout.lower()
    for dependency in ("numpy", "h5py", "pyzmq", "msgpack"):
        assert f"{dependency}==" in installed
    assert "torch==" not in installed and "gymnasium==" not in installed, "extras stay optional"
    demo = run(fresh / "bin" / "h5replay", "demo", "--actors", "2", "--episodes", "3", cwd=work)
    assert "h5replay demo: OK" in demo.stdout, demo.stdout
    licence = run(python, "-c", "import importlib.metadata as m; print(m.metadata('h5replay')['License-Expression'])",
                  cwd=work).stdout.strip()
    assert licence == "Apache-2.0"
