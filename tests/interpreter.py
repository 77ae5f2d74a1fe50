"""Run a kernel-case script under the Triton interpreter in a fresh process and read its JSON results.

TRITON_INTERPRET must be set before triton is first imported, and the test process may already hold
compiled-mode kernels, so each script runs in its own interpreter process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_under_interpreter(script: Path, *args: str) -> dict:
    """The JSON object on the last line `script` prints (given args), run with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
