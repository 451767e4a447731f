"""A small real Ray cluster on this machine for tests/ray_cluster (`make test-ray` installs Ray).

Three simulated nodes (a head and two more), each with 1 CPU and a small object store, no
dashboard, no usage reporting. Ray's workers import the test helpers from tests/ (PYTHONPATH is
set before the nodes start, and their workers inherit it). Skipped when Ray is not installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# tests/, where the helper modules are: on this process's sys.path through pytest's `pythonpath`
# setting (pyproject.toml); Ray's workers get it through PYTHONPATH below.
_TESTS = str(Path(__file__).resolve().parent.parent)

NUM_NODES = 3
_NODE = {"num_cpus": 1, "object_store_memory": 80 * 1024 * 1024}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_USAGE_STATS_ENABLED", "PYTHONPATH")}
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_TESTS, saved["PYTHONPATH"]) if p)
    cluster = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={**_NODE, "include_dashboard": False})
        for _ in range(NUM_NODES - 1):
            cluster.add_node(**_NODE)
        cluster.wait_for_nodes(timeout=60)
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
