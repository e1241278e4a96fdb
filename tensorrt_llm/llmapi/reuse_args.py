"""How the prefix-caching knobs of `LlmArgs` resolve (`enable_block_reuse`,
`vision_embedding_cache_mib`): kept apart so llm_args.py stays about validation."""

from __future__ import annotations

from typing import Any

import torch

# vision_embedding_cache_mib when not given, (off CUDA, on CUDA): on CUDA it is taken from the
# memory the KV cache is sized from; the CPU's cache is not sized from memory at all.
DEFAULT_VISION_EMBEDDING_CACHE_MIB = (64, 512)


def resolve_block_reuse(enable: bool | None, model: str, config: Any) -> bool:
    """Whether KV block reuse is on for the checkpoint whose HF `config` this is: the user's
    choice, else on unless the model is hybrid; True on a hybrid model is an error."""
    from .._torch.config_utils import is_hybrid_model

    hybrid = config is not None and is_hybrid_model(config)
    if enable and hybrid:
        raise ValueError(
            "kv_cache_config.enable_block_reuse=True is not supported for hybrid models "
            f"({model}: linear-attention layers): a prefix hit would skip the recurrent "
            "(conv / SSM) state of the cached tokens, and snapshots of that state per block "
            "are not implemented yet; leave it unset or False"
        )
    return not hybrid if enable is None else enable


def vision_embedding_cache_bytes(mib: int | None, device: torch.device) -> int:
    """The vision-embedding cache's bound (used only with block reuse and a tower)."""
    if mib is None:
        mib = DEFAULT_VISION_EMBEDDING_CACHE_MIB[device.type == "cuda"]
    return mib * 2**20
