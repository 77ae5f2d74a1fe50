import dataclasses

from engine.config import EngineConfig
from worker.cli import build_parser
from worker.settings import ENGINE_FIELDS


def test_every_engine_option_is_a_worker_setting_and_flag():
    options = {f.name for f in dataclasses.fields(EngineConfig) if f.init} - {"model"}
    assert options <= set(ENGINE_FIELDS), f"engine options without a worker setting: {options - set(ENGINE_FIELDS)}"
    worker = build_parser()._subparsers._group_actions[0].choices["worker"]
    flags = {opt for action in worker._actions for opt in action.option_strings}
    assert {"--" + name.replace("_", "-") for name in options} <= flags
