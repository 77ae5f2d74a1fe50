"""Sampling and constraints: each request's settings and their bounds (params.py: `SamplingParams`, which
producers import without torch), structured output's grammars on the host (grammar.py, regex_classes.py)
and their masks (grammar_mask.py), and the device side the runner calls: the sampler (sampler.py) with its
logit adjustments (penalties.py) and pinned host buffers (pinned.py).
"""
