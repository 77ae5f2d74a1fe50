import dataclasses
import json
import subprocess
import sys

from engine.config import EngineConfig
from queue_helpers import REPO_ROOT
from worker.cli import build_parser
from worker.settings import ENGINE_FIELDS, WorkerSettings


def _worker_actions() -> dict:
    worker = build_parser()._subparsers._group_actions[0].choices["worker"]
    return {opt: action for action in worker._actions for opt in action.option_strings}


def test_every_engine_option_is_a_worker_setting_and_flag():
    options = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"model"}
    assert options <= set(ENGINE_FIELDS), f"engine options without a worker setting: {options - set(ENGINE_FIELDS)}"
    flags = set(_worker_actions())
    assert {"--" + name.replace("_", "-") for name in options} <= flags


def test_each_engine_flag_prints_the_help_declared_with_the_engine_option():
    actions = _worker_actions()
    for f in dataclasses.fields(EngineConfig):
        if f.init and f.name != "model":
            assert f.metadata["help"] in actions["--" + f.name.replace("_", "-")].help, f.name


def test_an_engine_option_unset_keeps_the_engine_default_and_is_read_from_its_variable(monkeypatch):
    assert WorkerSettings().engine_kwargs == {}
    monkeypatch.setenv("REDLINE_KV_CACHE_DTYPE", "fp8")
    monkeypatch.setenv("REDLINE_ENFORCE_EAGER", "true")
    assert WorkerSettings().engine_kwargs == {"kv_cache_dtype": "fp8", "enforce_eager": True}


def test_the_cli_lists_the_engine_options_without_loading_torch():
    check = "import sys, worker.cli; worker.cli.build_parser(); print(__import__('json').dumps('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) is False
