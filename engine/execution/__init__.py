"""Execution on the device: the runner (model_runner.py, one GPU; distributed.py, tensor parallelism) that
implements `engine.runner.Runner`, executes a step's `StepInputs` through the model and samples, with CUDA
graphs (cuda_graphs.py, graph_edges.py). It never imports the engine's loop (engine/core/).
"""
