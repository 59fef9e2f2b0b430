"""symmring inside serving engines (`symmring.integrations.vllm`).

Kept apart from `symmring.moe.integrations` (transformers blocks, the torch module), which need only torch: an
engine integration brings the engine's own processes, groups and plugin hooks. Nothing in the core imports
this package, and importing it imports no engine.
"""
