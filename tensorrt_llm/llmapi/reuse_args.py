"""How the prefix-caching knobs of `LlmArgs` resolve (`enable_block_reuse`,
`vision_embedding_cache_mib`, `recurrent_state_snapshot_mib`): kept apart so llm_args.py stays
about validation."""

from __future__ import annotations

from typing import Any

import torch

# vision_embedding_cache_mib when not given, (off CUDA, on CUDA): on CUDA it is taken from the
# memory the KV cache is sized from; the CPU's cache is not sized from memory at all.
DEFAULT_VISION_EMBEDDING_CACHE_MIB = (64, 512)
# enable_block_reuse=None on hybrid models (Qwen3.5 / 3.6): off until measured to pay on the GPU
# (the extra prefill step per snapshot point and the snapshot copies against the hit).
HYBRID_BLOCK_REUSE_DEFAULT = False


def resolve_block_reuse(enable: bool | None, model: str, config: Any) -> bool:
    """Whether KV block reuse is on for the checkpoint whose HF `config` this is: the user's
    choice, else the default of its kind (`HYBRID_BLOCK_REUSE_DEFAULT` for hybrid models)."""
    from .._torch.config_utils import is_hybrid_model

    if enable is not None:
        return enable
    hybrid = config is not None and is_hybrid_model(config)
    return HYBRID_BLOCK_REUSE_DEFAULT if hybrid else True


def vision_embedding_cache_bytes(mib: int | None, device: torch.device) -> int:
    """The vision-embedding cache's bound (used only with block reuse and a tower)."""
    if mib is None:
        mib = DEFAULT_VISION_EMBEDDING_CACHE_MIB[device.type == "cuda"]
    return mib * 2**20


def recurrent_state_snapshot_bytes(mib: int | None) -> int | None:
    """The recurrent-snapshot pool's bound (used only with block reuse on a hybrid model);
    None: the engine's default, which depends on the memory left (`hybrid_kv_cache_reuse`)."""
    return None if mib is None else mib * 2**20
