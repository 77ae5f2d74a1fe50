"""Imports point down across the step's boundary: the runner side (engine/runner.py's protocol, the model
runner, the tensor-parallel driver, the sampler and what they run) never loads the engine loop, the
scheduler or the request's state, so it is called with plain step inputs and cannot call back."""
import ast
import json
import subprocess
import sys

from queue_helpers import REPO_ROOT

RUNNER_MODULES = ["engine.runner", "engine.model_runner", "engine.distributed", "engine.cuda_graphs",
                  "engine.sampler", "engine.penalties", "engine.grammar_mask", "engine.pinned"]
RUNNER_PACKAGES = ["layers", "attention", "kernels", "models"]  # what the runner executes
LOOP_MODULES = {"engine.llm_engine", "engine.scheduler", "engine.sequence", "engine.block_manager",
                "engine.step_builder", "engine.outputs", "engine.beam_search", "engine.detokenizer"}

CHECK = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("engine."))))
"""


def test_importing_the_runner_side_loads_no_module_of_the_engine_loop():
    out = subprocess.run([sys.executable, "-c", CHECK, *RUNNER_MODULES], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert set(RUNNER_MODULES) <= loaded
    assert loaded & LOOP_MODULES == set()


def test_no_runner_module_imports_the_engine_loop_even_inside_a_function():
    paths = [REPO_ROOT / (name.replace(".", "/") + ".py") for name in RUNNER_MODULES]
    paths += [p for pkg in RUNNER_PACKAGES for p in sorted((REPO_ROOT / "engine" / pkg).rglob("*.py"))]
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                module = node.module or ""
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            else:
                continue
            found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno} {n}" for n in names if n in LOOP_MODULES]
    assert found == []


def test_the_model_runner_and_the_tensor_parallel_driver_take_a_step_alike():
    import inspect

    from engine.distributed import TPDriver
    from engine.model_runner import ModelRunner
    from engine.runner import Runner

    for method in ("execute_model", "sample_tokens"):
        want = list(inspect.signature(getattr(Runner, method)).parameters)
        assert [list(inspect.signature(getattr(cls, method)).parameters) for cls in (ModelRunner, TPDriver)] == \
            [want, want], method
