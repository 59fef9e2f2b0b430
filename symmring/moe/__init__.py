"""MoE layers and their parts. The torch-facing names load on first use (symmring imports without torch):

* `MoEModule` (`symmring.moe.integrations.module`): the GPU layer as a ``torch.nn.Module``, its forward a torch
  custom op;
* `from_hf`, `replace_moe_blocks` (`symmring.moe.integrations.hf`): build it from transformers MoE blocks.
"""

_LAZY = {"MoEModule": "integrations.module", "moe_op": "integrations.module", "from_hf": "integrations.hf",
         "replace_moe_blocks": "integrations.hf"}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
