"""The engine's loop and scheduling: `LLMEngine` (llm_engine.py) steps requests through the scheduler
(scheduler.py), which decides which sequences (sequence.py) run and keeps their KV blocks (block_manager.py,
the prefix cache); step_builder.py turns a scheduled batch into the runner's plain `StepInputs`; outputs.py
is what a step hands back; beam_search.py chooses beams. It calls execution/ through `engine.runner.Runner`.
"""
