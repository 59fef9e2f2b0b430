"""The GPU layer's constructor loads every device module its calls launch (compiled once per node through
`symmring.jit`, loaded into this PE), so no PE compiles symmring's kernels inside a call while the others wait
in that call's token-count exchange (issue 33, item 6: that exchange is bounded by the host bound, and a cold
compile must not be what it waits for).

Several PEs (run it alone, so that no earlier test loaded the modules)::

    python -m symmring.launch -n 2 --mps [--torchrun] -- python -m pytest tests/gpu/test_modules_before_calls.py
"""

from __future__ import annotations

import pytest

from moe_helpers import gpu_layer_torch  # noqa: E402

torch = gpu_layer_torch()  # or the whole module skips, with the reason

from moe_helpers import verdict  # noqa: E402
from test_workspace import NUM_EXPERTS, build  # noqa: E402  (the layers of the workspace tests)

from symmring import jit  # noqa: E402
from symmring.moe.workspace import Workspace  # noqa: E402

pytestmark = pytest.mark.gpu


def test_constructor_loads_every_library_module(nvshmem_ctx):
    ctx = nvshmem_ctx
    if NUM_EXPERTS % ctx.world_size:
        pytest.skip(f"the workspace tests' layers split {NUM_EXPERTS} experts evenly: not over {ctx.world_size} PEs")
    if set(jit.LIBRARY_MODULES) <= set(ctx.backend._library):
        pytest.skip("an earlier test of this session loaded every module already: run this file alone")
    workspace = Workspace(ctx, max_tokens=32)
    moe, _, _ = build(ctx, workspace, (256, 128, 2, "torch"), 7, 32)
    loaded = set(ctx.backend._library)  # NvshmemBackend.library_module's modules, by name
    missing = sorted(set(jit.LIBRARY_MODULES) - loaded)
    moe.close()
    workspace.close()
    verdict(ctx, not missing, f"modules not loaded by the constructor: {missing} (loaded {sorted(loaded)})")
