"""The README's "Use it from an engine" example runs exactly as written.

The code block is read out of README.md and run in a fresh interpreter (the way a reader
pastes it), with its temporary directory under pytest's tmp_path.
"""
from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import REPO, child_env

SECTION = "## Use it from an engine"


def readme_example() -> str:
    """The first ```python block of the README's engine section."""
    text = (REPO / "README.md").read_text()
    assert SECTION in text, f"README.md lost its {SECTION!r} section"
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, f"no ```python block under {SECTION!r}"
    return m.group(1)


def test_engine_example_runs_as_written(tmp_path):
    env = child_env(TMPDIR=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=300)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    requests = [ln for ln in r.stdout.splitlines() if " blocks: " in ln]
    assert len(requests) == 2, r.stdout
    # The first prompt finds nothing; the next turn loads the blocks the first one put.
    first_blocks = int(requests[0].split()[0])
    assert ": 0 loaded" in requests[0] and f": {first_blocks} loaded" in requests[1], r.stdout
    assert re.search(r"^hit ratio \d+%$", r.stdout, re.M), r.stdout
    assert not any(tmp_path.iterdir()), "the example's temporary directory was left behind"

