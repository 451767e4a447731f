"""Every script in examples/ and every Python block of README.md and docs/*.md runs as printed.

Each runs as a script of its own (`python snippet.py`, so `if __name__ == "__main__":` means what
it says) in a fresh temporary directory, with a timeout. The line just before a block's fence may
hold a marker (docs/design.md, "Snippets that run", is the reference):

    <!-- snippet: server -->       a CartPole server holding 10 episodes is started for the block,
                                   and its endpoint put in place of tcp://127.0.0.1:5555
    <!-- snippet: continues -->    the page's previous runnable block runs first, in the same script
    <!-- snippet: no-run (why) --> not run

Without `server`, tcp://127.0.0.1:5555 becomes tcp://127.0.0.1:0 (any free port), which a block
that starts its own server binds. A block (or example) importing a package that is not installed
(torch, stable_baselines3, ray...) is skipped: its imports are read from its source.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from service_helpers import endpoint

from h5replay.client import ActorClient
from h5replay.config import ServerConfig
from h5replay.server import ServerProcess
from h5replay.spaces import DictSpace, space_from_json

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
EXAMPLE_ENDPOINT = "tcp://127.0.0.1:5555"
MARKER = re.compile(r"^<!--\s*snippet:\s*(?P<options>.*?)\s*-->\s*$")
OPTIONS = {"server", "continues", "no-run"}
RUN_TIMEOUT = 90.0  # seconds for one block or example, start-up of its server and imports included
MAX_NO_RUN = 4  # blocks that are not run: keep them few


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str  # with the blocks it continues, in order
    options: frozenset[str]
    server: bool  # this block or one it continues asks for a server

    @property
    def id(self) -> str:
        return f"{_shown(self.page)}:{self.line}"


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _options(marker_line: str, where: str) -> frozenset[str]:
    match = MARKER.match(marker_line.strip())
    if not match:
        return frozenset()
    words = {part.strip().split(" ", 1)[0] for part in match["options"].split(",") if part.strip()}
    unknown = words - OPTIONS
    assert not unknown, f"{where}: unknown snippet marker {sorted(unknown)}; known: {sorted(OPTIONS)}"
    return frozenset(words)


def python_blocks(page: Path) -> list[Block]:
    """The ```python blocks of a page, each with its marker's options and the code it continues."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    previous: Block | None = None  # the last runnable block of the page
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page}:{i + 1}: a fence that never closes"
        if fence == "```python":
            where = f"{_shown(page)}:{i + 1}"
            options = _options(lines[i - 1] if i else "", where)
            code = "\n".join(lines[i + 1:end]) + "\n"
            server = "server" in options
            if "continues" in options:
                assert previous is not None, f"{where}: 'continues' with no runnable block before it"
                code = previous.code + "\n" + code
                server = server or previous.server
            block = Block(page, i + 1, code, options, server)
            blocks.append(block)
            if "no-run" not in options:
                previous = block
        i = end + 1
    return blocks


ALL_BLOCKS = [b for page in PAGES for b in python_blocks(page)]
RUNNABLE = [b for b in ALL_BLOCKS if "no-run" not in b.options]


def missing_modules(code: str) -> list[str]:
    """Top-level packages the code imports that are not installed, and integrations of h5replay
    whose optional packages are not (an `h5replay.integrations.X` that fails to import)."""
    names: set[str] = set()
    integrations: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
        for module in modules:
            names.add(module.split(".")[0])
            if module.startswith("h5replay.integrations."):
                integrations.add(module)
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    for module in sorted(integrations):
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(f"{module}'s extra")
    return sorted(missing)


def run_script(path: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    # One thread for torch's and numpy's kernels: the suite runs several of these beside each other.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(path)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT)


def cartpole_episode(rng: np.random.Generator, length: int) -> dict[str, np.ndarray]:
    obs = rng.uniform(-0.05, 0.05, (length, 4)).astype(np.float32)
    return {"obs": obs, "action": rng.integers(0, 2, length), "reward": np.ones(length, np.float32),
            "terminated": np.arange(length) == length - 1, "truncated": np.zeros(length, bool)}


@contextlib.contextmanager
def cartpole_server(directory: Path) -> Iterator[ServerProcess]:
    """The server a `server` block is given: docker/cartpole-space.json's rows, final observations
    kept, 10 episodes of 20-60 steps held."""
    spec = json.loads((ROOT / "docker" / "cartpole-space.json").read_text())
    # Ports below the ephemeral range, from this xdist worker's slice (service_helpers.free_port):
    # a port 0 one the kernel hands out can be taken by the tests beside this one.
    config = ServerConfig(path=str(directory / "served-to-snippet.h5"), space=space_from_json(spec), capacity=100_000,
                          bind=endpoint(), read_bind=endpoint(), observation_keys=tuple(spec["observation_keys"]))
    server = ServerProcess(config, timeout=60)
    try:
        rng = np.random.default_rng(0)
        with ActorClient(server.endpoint, timeout=10) as actor:
            for _ in range(10):
                episode = cartpole_episode(rng, int(rng.integers(20, 60)))
                actor.push_episode(episode, final=rng.uniform(-0.05, 0.05, 4).astype(np.float32))
        yield server
    finally:
        server.stop(timeout=20)


# ------------------------------------------------------------------------------ the doc blocks


@pytest.mark.timeout(RUN_TIMEOUT + 60)
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_the_block_runs_as_printed(block: Block, tmp_path: Path) -> None:
    missing = missing_modules(block.code)
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    script = tmp_path / "snippet.py"
    with contextlib.ExitStack() as stack:
        if block.server:
            server = stack.enter_context(cartpole_server(tmp_path))
            script.write_text(block.code.replace(EXAMPLE_ENDPOINT, server.endpoint))
        else:
            script.write_text(block.code.replace(EXAMPLE_ENDPOINT, "tcp://127.0.0.1:0"))
        done = run_script(script, tmp_path)
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout}\n{done.stderr}"


def test_the_pages_have_python_blocks_and_few_that_do_not_run() -> None:
    assert len(RUNNABLE) >= 15, [b.id for b in RUNNABLE]
    assert any(b.page.name == "README.md" for b in RUNNABLE)
    no_run = [b.id for b in ALL_BLOCKS if "no-run" in b.options]
    assert len(no_run) <= MAX_NO_RUN, f"keep the blocks that are not run few: {no_run}"


def test_a_marker_is_read_from_the_line_before_the_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\na = 1\n```\n\n<!-- snippet: continues, server -->\n```python\nb = a\n```\n"
                    "<!-- snippet: no-run (a fragment) -->\n```python\nc(\n```\n```bash\nls\n```\n")
    first, second, third = python_blocks(page)
    assert first.options == frozenset() and not first.server
    assert second.options == {"continues", "server"} and second.code == "a = 1\n\nb = a\n" and second.server
    assert third.options == {"no-run"}
    (tmp_path / "bad.md").write_text("<!-- snippet: sever -->\n```python\npass\n```\n")
    with pytest.raises(AssertionError, match="unknown snippet marker"):
        python_blocks(tmp_path / "bad.md")


def test_the_space_file_example_writes_what_serve_reads(tmp_path: Path) -> None:
    block = next(b for b in ALL_BLOCKS if b.code.startswith("# myspaces.py"))
    (tmp_path / "myspaces.py").write_text(block.code)
    done = run_script(tmp_path / "myspaces.py", tmp_path)
    assert done.returncode == 0, done.stderr
    written = json.loads((tmp_path / "space.json").read_text())
    space = space_from_json(written)
    assert isinstance(space, DictSpace) and sorted(space.keys()) == ["action", "done", "obs"]
    same = subprocess.run([sys.executable, "-m", "h5replay", "space", "python", "myspaces:ROW"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert same.returncode == 0, same.stderr
    assert json.loads(same.stdout) == written


# ------------------------------------------------------------------------------ the README


def test_the_readme_is_short_and_links_to_pages_that_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\((docs/[^)#]+)", text)
    assert links, "the README links to the docs"
    for link in links:
        assert (ROOT / link).is_file(), link
    for part in ("make demo", "make test", "pip install dist/h5replay-", 'if __name__ == "__main__":',
                 "## Which mode do I want", "## Guarantees in brief"):
        assert part in text, part


# ------------------------------------------------------------------------------ examples/


@pytest.mark.timeout(RUN_TIMEOUT + 30)
@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_the_example_runs(example: Path, tmp_path: Path) -> None:
    missing = missing_modules(example.read_text())
    if missing:
        pytest.skip(f"needs {', '.join(missing)}, not installed")
    done = run_script(example, tmp_path)
    assert done.returncode == 0, f"{example.name} failed:\n{done.stdout}\n{done.stderr}"
    assert done.stdout.strip(), "an example says what it did"


@pytest.mark.parametrize("source", [*EXAMPLES, *RUNNABLE], ids=[p.name for p in EXAMPLES] + [b.id for b in RUNNABLE])
def test_only_loopback_endpoints(source: Path | Block) -> None:
    code = source.read_text() if isinstance(source, Path) else source.code
    assert all(e.startswith("tcp://127.0.0.1:") for e in re.findall(r"tcp://[^\s\"']+", code)), "bind loopback only"


def test_there_are_the_four_examples() -> None:
    assert {p.name for p in EXAMPLES} >= {"local_buffer.py", "cartpole_service.py", "prioritized_replay.py", "shards.py"}
    for example in EXAMPLES:
        assert 'if __name__ == "__main__":' in example.read_text(), example.name
