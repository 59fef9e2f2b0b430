"""MoE layers and their parts (docs/DESIGN.md has the map). The layer is `MoE` (`symmring.moe.layer`: the
implementation of the context's backend); the names below load on first use (symmring imports without torch):

* `MoE`, `Experts`, `RoutingConfig`, `ScheduleConfig` (`symmring.moe.layer`, `symmring.moe.config`);
* `GpuMoE` (`symmring.moe.gpu`), `ExpertParallelMoE`, `HostLayer`, `MoEShapes`, `shard_experts`, `local_experts`
  (`symmring.moe.cpu`): the implementations, and the CPU layer's helpers;
* `Workspace` (`symmring.moe.workspace`), `reference_moe` (`symmring.moe.reference`);
* `MoEModule` (`symmring.moe.integrations.module`): the layer as a ``torch.nn.Module``, its forward a torch
  custom op;
* `from_hf`, `replace_moe_blocks` (`symmring.moe.integrations.hf`): build it from transformers MoE blocks.
"""

_LAZY = {"MoE": "layer", "Experts": "config", "RoutingConfig": "config", "ScheduleConfig": "config",
         "GpuMoE": "gpu", "ExpertParallelMoE": "cpu.layer", "MoEShapes": "cpu.layer", "shard_experts": "cpu.layer",
         "local_experts": "cpu.layer", "HostLayer": "cpu.host_layer", "Workspace": "workspace",
         "reference_moe": "reference", "MoEModule": "integrations.module", "moe_op": "integrations.module",
         "from_hf": "integrations.hf", "replace_moe_blocks": "integrations.hf"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
