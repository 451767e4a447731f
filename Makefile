# Two commands: `make demo` and `make test`. Each creates .venv when missing and installs
# everything it needs into it from the package registries. CI (.ci/run) also runs test-model, test-torch,
# test-ray, test-interop and compose-test.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# pip into .venv, editable (compat: a plain path entry, which mypy, spawned processes and Ray's
# workers all follow). PYTHONWARNINGS=ignore hides setuptools' notice box about that mode.
PIP := PYTHONWARNINGS=ignore $(BIN)/python -m pip
EDITABLE := --config-settings editable_mode=compat
# PyTorch for test-torch: pip's torch==2.13.0 is a CPU build on the machines this project runs on;
# elsewhere the CPU build comes from PyTorch's own index (a plain `pip install torch` on Linux
# fetches the CUDA build, several GB): make test-torch TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu"
TORCH_VERSION ?= 2.13.0
TORCH_INDEX ?=

.PHONY: demo check test lint wheel test-wheel docs test-model test-torch test-ray test-interop test-lerobot compose-test bench mutation clean venv

$(BIN)/python:
	@echo "Creating $(VENV) (a virtual environment in this checkout) ..."
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@echo "Installing h5replay with its test and lint tools into $(VENV) (a minute on a fresh machine) ..."
	$(PIP) install --quiet -e '.[dev,metrics,gym,compression]' $(EDITABLE)
	touch $(STAMP) $(DEMO_STAMP)

# The demo needs only h5replay and its four dependencies (numpy, h5py, pyzmq, msgpack).
$(DEMO_STAMP): $(BIN)/python pyproject.toml
	@echo "Installing h5replay and numpy, h5py, pyzmq, msgpack into $(VENV) (about 20 s on a fresh machine) ..."
	$(PIP) install --quiet -e . $(EDITABLE)
	touch $(DEMO_STAMP)

venv: $(STAMP)

demo: $(DEMO_STAMP)
	@echo "Running the demo: a server, 4 actor processes and a learner on 127.0.0.1 (about 10 s) ..."
	$(BIN)/python -m h5replay demo

# The quick lane, for every change: lint, types, then the unit and property tests (no server
# process, no sockets; under 2 minutes on 2 cores).
check: lint
	$(BIN)/python -m pytest tests/unit tests/property

# Everything: lint and types first (seconds), then the whole suite. Most of it runs in 4 worker
# processes (pytest-xdist): many of its tests wait, on sockets, timeouts and processes starting,
# and 4 workers on 2 cores overlap those waits. A module whose fixture serves all its tests stays
# on one worker (xdist_group, --dist loadgroup). Then the tests marked `serial` run alone: they
# measure rates or wall time, which tests running beside them would skew.
XDIST_WORKERS ?= 4
test: lint
	$(BIN)/python -m pytest -n $(XDIST_WORKERS) --dist loadgroup -m "not serial and not packaging"
	$(BIN)/python -m pytest -m serial

# The wheel and the sdist, in dist/, with their metadata checked (what a user installs with
# `pip install dist/h5replay-*.whl`).
wheel: $(STAMP)
	rm -rf dist
	$(BIN)/python -m build --outdir dist .
	$(BIN)/python -m twine check --strict dist/*

# The wheel installed into a fresh venv (its dependencies from the package registry) runs the demo.
test-wheel: $(STAMP)
	$(BIN)/python -m pytest -m packaging tests/packaging

# The documentation site (mkdocs.yml, docs/): the docs extra into .venv, then a strict build into site/.
docs: $(STAMP)
	$(PIP) install --quiet -e '.[docs]' $(EDITABLE)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check h5replay tests docker benchmarks examples
	$(BIN)/mypy

# The model-based test of the whole service, long profile: 40 seeded walks of 60 steps over two
# real shards (`make test` runs the short one: 4 walks of 25 steps).
test-model: $(STAMP)
	H5REPLAY_MODEL_PROFILE=long $(BIN)/python -m pytest -n 2 tests/faults/test_service_model.py

# The PyTorch integration's tests, which `make test` skips while torch is not installed, and a DQN
# that solves CartPole-v1 from n-step transitions served through H5ReplayDataset.
test-torch: $(STAMP)
	$(PIP) install --quiet $(TORCH_INDEX) 'torch==$(TORCH_VERSION)'
	$(BIN)/python -m pytest tests/unit/test_torch_integration.py tests/integration/test_dqn_cartpole.py

# The adapters to other RL libraries (tests/interop, which `make test` skips while they are not
# installed), each against the real package: Stable-Baselines3, TorchRL (with PyTorch, as test-torch) and
# Minari (with minari[create], for its DataCollector),
# then LeRobot (test-lerobot, in a venv of its own).
test-interop: $(STAMP)
	$(PIP) install --quiet $(TORCH_INDEX) 'torch==$(TORCH_VERSION)'
	$(PIP) install --quiet $(TORCH_INDEX) -e '.[sb3,torchrl,minari]' 'minari[create]' 'torch==$(TORCH_VERSION)' $(EDITABLE)
	$(BIN)/python -m pytest tests/interop --ignore=tests/interop/test_lerobot.py
	$(MAKE) test-lerobot

# LeRobot in a venv of its own (.venv-lerobot): lerobot 0.4.4 (the newest for Python 3.11) needs
# torchvision, which PyPI's torch 2.13.0 CPU build cannot load, and numpy < 2.3 (its add_frame
# fails on 2.4). So: torch 2.14.1 + torchvision 0.29.1 (on x86_64 pip takes them from this
# machine's disk; elsewhere set LEROBOT_TORCH), lerobot without its torch<2.11 pin, then the
# rest of its requirements. About 2 minutes and 6 GB the first time.
LEROBOT_VENV := .venv-lerobot
LEROBOT_TORCH ?= torch==2.14.1 torchvision==0.29.1
LEROBOT_DEPS := 'datasets>=4.0.0,<5.0.0' 'huggingface-hub>=0.34.2,<0.36.0' 'av>=15.0.0,<16.0.0' 'draccus==0.10.0' \
	'jsonlines>=4.0.0,<5.0.0' 'packaging>=24.2,<26.0' 'einops>=0.8.0,<0.9.0' 'termcolor>=2.4.0,<4.0.0' \
	'deepdiff>=7.0.1,<9.0.0' 'imageio[ffmpeg]>=2.34.0,<3.0.0' 'accelerate>=1.10.0,<2.0.0' 'numpy>=2.0,<2.3'
$(LEROBOT_VENV)/.installed: pyproject.toml
	@echo "Installing lerobot 0.4.4 and torch into $(LEROBOT_VENV) (a few minutes the first time) ..."
	test -x $(LEROBOT_VENV)/bin/python || $(PYTHON) -m venv $(LEROBOT_VENV)
	PYTHONWARNINGS=ignore $(LEROBOT_VENV)/bin/python -m pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(LEROBOT_VENV)/bin/python -m pip install --quiet $(LEROBOT_TORCH)
	PYTHONWARNINGS=ignore $(LEROBOT_VENV)/bin/python -m pip install --quiet -e '.[dev,gym,lerobot]' $(EDITABLE)
	PYTHONWARNINGS=ignore $(LEROBOT_VENV)/bin/python -m pip install --quiet --no-deps 'lerobot==0.4.4'
	PYTHONWARNINGS=ignore $(LEROBOT_VENV)/bin/python -m pip install --quiet $(LEROBOT_DEPS) $(LEROBOT_TORCH)
	touch $@

test-lerobot: $(LEROBOT_VENV)/.installed
	$(LEROBOT_VENV)/bin/python -m pytest tests/interop/test_lerobot.py

# Ray for h5replay.integrations.ray and its tests (tests/ray_cluster, which `make test` skips while Ray
# is not installed; not "tests/ray": tests/ is on sys.path and that folder would shadow the ray
# package): a local cluster of 3 simulated nodes, 1 CPU each, small object stores, no dashboard.
test-ray: $(STAMP)
	$(PIP) install --quiet -e '.[ray]' $(EDITABLE)
	RAY_USAGE_STATS_ENABLED=0 $(BIN)/python -m pytest tests/ray_cluster

# The image and docker/compose.yaml (then with compose.auth.yaml) run for real: see docker/compose_test.py.
# Sets up the Docker Engine when missing (as root, with apt-get); says why and exits 0 when it cannot.
compose-test: $(STAMP)
	$(BIN)/python docker/compose_test.py

# Mutation testing of the recovery paths (journal, key table, priority log, recovery, export), with
# mutmut over the tests [tool.mutmut] in pyproject.toml names; not part of `make test` or CI. A run
# takes a while on 2 cores; `mutmut results` and `mutmut show NAME` say what survived.
MUTMUT_VERSION ?= 3.8.1
mutation: $(STAMP)
	$(PIP) install --quiet 'mutmut==$(MUTMUT_VERSION)'
	$(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results

bench: $(STAMP)
	$(BIN)/python benchmarks/storage.py

clean:
	rm -rf $(VENV) $(LEROBOT_VENV) build *.egg-info .pytest_cache .hypothesis .mypy_cache mutants
