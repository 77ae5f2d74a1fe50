"""Imports point down: the producer (the client library and the wire contract) never loads the worker,
nor torch, so a producer installs and imports without a GPU stack."""
import ast
import json
import subprocess
import sys

from queue_helpers import REPO_ROOT

CHECK = """
import json, pkgutil, importlib, sys
import producer
names = ["producer"] + [m.name for m in pkgutil.walk_packages(producer.__path__, "producer.")]
for name in names:
    importlib.import_module(name)
loaded = [m for m in sys.modules if m == "worker" or m.startswith("worker.") or m == "torch" or m.startswith("torch.")]
print(json.dumps({"imported": names, "loaded": sorted(loaded)}))
"""


def test_importing_every_producer_module_loads_no_worker_module_and_no_torch():
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"producer.client", "producer.protocol", "producer.scripts", "producer.batch",
            "producer.gateway.app"} <= set(report["imported"])
    assert report["loaded"] == []


def test_no_producer_module_imports_the_worker_even_inside_a_function():
    found = []
    for path in sorted((REPO_ROOT / "producer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            found += [f"{path.name}:{node.lineno} {n}" for n in names if n == "worker" or n.startswith("worker.")]
    assert found == []
