"""symmring's ``vllm.general_plugins`` entry point (setup.cfg): `register`.

vLLM calls every installed general plugin in each of its processes (the front end, the engine core, each
worker) before it builds a model. `register` does nothing unless ``SYMMRING_VLLM=1``; then it makes every
MoE layer of the models vLLM builds run symmring (`symmring.integrations.vllm.method`), for the vLLM versions
it was written against (`SUPPORTED`), and refuses any other with a `ConfigError` naming both.
"""

from __future__ import annotations

import logging

from ... import env
from ...errors import ConfigError

log = logging.getLogger(__name__)

#: vLLM releases whose fused-MoE modular kernel this integration was written against (``major.minor``).
SUPPORTED = ("0.32",)


def register() -> None:
    """Make vLLM's MoE layers run symmring when ``SYMMRING_VLLM=1`` (idempotent: vLLM may call it again).

    Raises:
        ConfigError: a vLLM release outside `SUPPORTED`, or another plugin that replaced vLLM's
            ``RoutedExperts`` already.
    """
    if not env.vllm_enabled():
        return
    import vllm
    release = ".".join(vllm.__version__.split(".")[:2])
    if release not in SUPPORTED:
        raise ConfigError(f"SYMMRING_VLLM=1 with vLLM {vllm.__version__}: symmring's experts were written against "
                          f"vLLM {', '.join(SUPPORTED)} (its fused-MoE modular kernel); unset SYMMRING_VLLM")
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from .method import SymmringRoutedExperts
    current = op_registry_oot.get(RoutedExperts.__name__)
    if current is SymmringRoutedExperts:
        return
    if current is not None:
        raise ConfigError(f"SYMMRING_VLLM=1: vLLM's RoutedExperts is replaced by {current.__module__}."
                          f"{current.__qualname__} already (another plugin); symmring cannot replace it too")
    RoutedExperts.register_oot(SymmringRoutedExperts)
    log.info("symmring: vLLM's MoE layers run symmring's expert-parallel experts")


__all__ = ["register", "SUPPORTED"]
