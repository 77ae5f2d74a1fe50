"""Imports point down through the engine's rooms: kernels, then the model's layers and models, LoRA adapters, the inputs,
the step's boundary (engine/runner.py), the configuration, sampling, execution on the device, and last the
loop (engine/core/). Nothing imports a room above its own, even inside a function, so the runner is called
with plain step inputs and cannot call back into the loop."""
import ast
import json
import subprocess
import sys

from queue_helpers import REPO_ROOT

# lowest first: a module may import its own room and the rooms before it
ROOMS = ["builtin", "kernels", "attention", "layers", "models", "lora", "inputs", "runner", "options", "config", "sampling",
         "execution", "core"]
ENGINE = REPO_ROOT / "engine"
CHECK = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(m for m in sys.modules if m.startswith("engine."))))
"""


def room_of(module: str) -> str | None:
    """`engine.execution.model_runner` -> "execution"; None for the package itself."""
    parts = module.split(".")
    return parts[1] if parts[0] == "engine" and len(parts) > 1 else None


def imported_modules(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield node.lineno, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module == "engine" else [node.module]
            yield node.lineno, names


def test_every_room_is_named_in_the_order():
    rooms = {p.name for p in ENGINE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    rooms |= {p.stem for p in ENGINE.glob("*.py") if p.stem != "__init__"}
    assert rooms == set(ROOMS)


def test_no_engine_module_imports_a_room_above_its_own():
    upward = []
    for path in sorted(ENGINE.rglob("*.py")):
        parts = path.relative_to(ENGINE).with_suffix("").parts
        if parts == ("__init__",):
            continue
        rank = ROOMS.index(parts[0])
        for line, names in imported_modules(ast.parse(path.read_text())):
            for name in names:
                target = room_of(name)
                if target in ROOMS and ROOMS.index(target) > rank:
                    upward.append(f"{path.relative_to(REPO_ROOT)}:{line} imports {name}")
    assert upward == []


def test_importing_execution_and_sampling_loads_nothing_of_the_loop():
    modules = ["engine.execution.model_runner", "engine.execution.distributed", "engine.sampling.sampler",
               "engine.sampling.grammar_mask"]
    out = subprocess.run([sys.executable, "-c", CHECK, *modules], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert set(modules) <= loaded and not {m for m in loaded if room_of(m) == "core"}


def test_the_model_runner_and_the_tensor_parallel_driver_take_a_step_alike():
    import inspect

    from engine.execution.distributed import TPDriver
    from engine.execution.model_runner import ModelRunner
    from engine.runner import Runner

    for method in ("execute_model", "sample_tokens"):
        want = list(inspect.signature(getattr(Runner, method)).parameters)
        assert [list(inspect.signature(getattr(cls, method)).parameters) for cls in (ModelRunner, TPDriver)] == \
            [want, want], method
