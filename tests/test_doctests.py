"""Every docstring example of the package runs (the CPU ones here; GPU ones are marked ``+SKIP``).

Each module with examples is one test: its examples run in the module's namespace, as a reader would
paste them after importing the module (so an example imports what it uses). Examples that need torch
skip when torch is absent, the compile example when nvcc or the nvidia-nvshmem wheel is.
"""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import io
import pkgutil
import shutil

import pytest

import symmring
from symmring import deps

#: Modules whose examples need torch (CPU is enough).
NEEDS_TORCH = {"symmring.moe.routing", "symmring.moe.torch_ref", "symmring.moe.weights",
               "symmring.moe.integrations.module", "symmring.moe.cpu.host_layer",
               "symmring.integrations.vllm.adapter"}
#: Modules that import vLLM (the vllm extra): not imported where it is not installed.
NEEDS_VLLM = {"symmring.integrations.vllm.experts", "symmring.integrations.vllm.method"}
#: Modules whose examples compile device code (nvcc and the nvidia-nvshmem wheel, no GPU).
NEEDS_NVCC = {"symmring.jit"}
#: GPU examples not yet marked ``# doctest: +SKIP``; their files belong to the GPU layer's work. strict:
#: once they are marked, the XPASS fails until the module leaves this list.
PENDING_GPU_MARKS: set = set()
#: CPU modules that must keep at least one example that runs.
MUST_HAVE_EXAMPLES = {"symmring.protocol", "symmring.layout", "symmring.moe.quant", "symmring.moe.reference",
                      "symmring.moe.gpu.policy", "symmring.moe.gpu.plan", "symmring.context", "symmring.ring",
                      "symmring.env", "symmring.moe.cpu.layer", "symmring.mpi", "symmring.deps",
                      "symmring.launch", "symmring.backends.host", "symmring.moe.layer", "symmring.moe.spec",
                      "symmring.moe.debug", "symmring.moe.calls", "symmring.moe.config"}


def _modules_with_examples():
    found = {}
    vllm = importlib.util.find_spec("vllm") is not None
    for info in pkgutil.walk_packages(symmring.__path__, "symmring."):
        if info.name in NEEDS_VLLM and not vllm:
            continue
        module = importlib.import_module(info.name)
        tests = [t for t in doctest.DocTestFinder().find(module) if t.examples]
        if tests:
            found[info.name] = tests
    return found


EXAMPLES = _modules_with_examples()


def test_cpu_modules_keep_their_examples():
    assert MUST_HAVE_EXAMPLES <= set(EXAMPLES), sorted(MUST_HAVE_EXAMPLES - set(EXAMPLES))
    assert PENDING_GPU_MARKS <= set(EXAMPLES)


def _param(name):
    marks = []
    if name in PENDING_GPU_MARKS:
        marks.append(pytest.mark.xfail(strict=True, reason=f"{name}: GPU examples not marked +SKIP yet"))
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("name", [_param(n) for n in sorted(EXAMPLES)])
def test_docstring_examples_run(name):
    if name in NEEDS_TORCH and not deps.installed("torch"):
        pytest.skip("the examples use torch, which is not installed")
    if name in NEEDS_NVCC and (shutil.which("nvcc") is None or not deps.installed("nvidia.nvshmem")):
        pytest.skip("the example compiles device code: needs nvcc and nvidia-nvshmem (pip install 'symmring[device]')")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    report = io.StringIO()
    for test in EXAMPLES[name]:
        runner.run(test, out=report.write)
    results = runner.summarize(verbose=False)
    assert results.failed == 0, report.getvalue()
    if results.attempted == 0:
        pytest.skip("every example is marked +SKIP (needs a GPU)")
