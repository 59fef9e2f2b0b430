"""Tests of symmring inside vLLM (`symmring.integrations.vllm`): they need vLLM (the ``vllm`` extra, vLLM's CPU
build) and are marked ``vllm``. CI runs them in a venv of their own (.ci/run's second stage,
``python -m pytest -q -m vllm``); elsewhere they skip with the reason. README, "Serving with vLLM".
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: vllm_problem

# vLLM's engine core in the test process (no spawned engine process per LLM) unless the caller chose.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.vllm)
