"""A CPU engine of a small model runs torch on one thread (many threads stall each other on a loaded machine:
docs/performance.md, CPU); a wider model, or a process whose OMP_NUM_THREADS says otherwise, keeps torch's."""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from queue_helpers import tiny_engine


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_cpu_engine_of_the_tiny_model_runs_on_one_thread(two_threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    engine = tiny_engine()
    assert engine.config.cpu_threads == 1 and torch.get_num_threads() == 1


def test_omp_num_threads_is_kept_where_set(two_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    engine = tiny_engine()
    assert engine.config.cpu_threads is None and torch.get_num_threads() == 2


def test_a_wider_model_keeps_torchs_thread_count(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert EngineConfig("qwen3-8b", load_format="dummy", device="cpu").cpu_threads is None
