"""Smoke test of examples/transformers_generate.py under ``syncless trace`` (needs transformers and a GPU)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gpu
def test_transformers_generate_under_trace_lists_syncs_in_transformers_code():
    pytest.importorskip("transformers")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, "-m", "syncless", "trace",
               "--fn", "transformers.generation.utils:GenerationMixin.generate",
               str(ROOT / "examples" / "transformers_generate.py"), "--new-tokens", "16"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=280, cwd=ROOT)
    print(result.stdout)
    print(result.stderr, file=sys.stderr)
    assert result.returncode == 0
    assert "transformers generate: 4 sequences x 16 new tokens on cuda" in result.stdout
    # The table's rows: a count, then the user's line that called into transformers (an installed package's frames
    # are skipped for the site, issue 34 item 5); the frame inside transformers is kept as "via".
    sites = [line for line in result.stdout.splitlines()
             if re.match(r"\s+\d+\s+\S*examples/transformers_generate\.py:\d+", line)]
    assert sites, "no sync site at the example's own lines"
    assert re.search(r"via: \S*transformers/\S+\.py:\d+", result.stdout), "the transformers frame is not named as via"
