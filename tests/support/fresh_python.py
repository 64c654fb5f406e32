"""Run a snippet in a fresh Python process and say whether it imported a module (what a test cannot see in-process)."""

from __future__ import annotations

import os
import subprocess
import sys


def imports_module(code: str, module: str, timeout_s: float = 120.0) -> bool:
    """Run ``code`` in a new interpreter with this one's ``sys.path``; return whether ``module`` got imported."""
    probe = f"{code}\nimport sys\nprint({module!r} in sys.modules)\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env,
                         timeout=timeout_s).stdout
    return out.strip().splitlines()[-1] == "True"
