"""What `create_py_executor` does for MTP speculation: the head before loading, its KV layers,
the scheduler's draft room and the executor's `SpecDecoder` (small hooks in the creator);
under tensor parallelism the decoder's link to the worker ranks (tp_spec.py)."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from ...models.modeling_qwen3_5_mtp import num_mtp_layers, with_mtp
from ...models.modeling_qwen3_next import Qwen3_5TextForCausalLM
from .config import SPEC_WITH_REUSE_ERROR
from .mtp_drafter import MTPDrafter
from .rollback import RECURRENT_PREFIX
from .spec_decoder import SpecDecoder
from .tp_spec import SpecLink

if TYPE_CHECKING:
    from ..engine_config import EngineConfig
    from ..kv_cache_creator import KVCacheSpec
    from ..py_executor import PyExecutor

logger = logging.getLogger(__name__)


def text_lm(model: object) -> Qwen3_5TextForCausalLM:
    """The Qwen3.5 text causal LM of a VL model (`.llm`) or the LM itself."""
    lm = getattr(model, "llm", model)
    if not isinstance(lm, Qwen3_5TextForCausalLM):
        raise ValueError(
            f"speculative_config (MTP) needs a Qwen3.5 / Qwen3.6 text stack, got "
            f"{type(lm).__name__}"
        )
    return lm


def prepare_mtp(model: nn.Module, attn_backend: str) -> None:
    """Give the model its MTP head before the weights load (runs on the meta device)."""
    with_mtp(text_lm(model), attn_backend=attn_backend)


def kv_spec_with_mtp(spec: KVCacheSpec, config: EngineConfig) -> KVCacheSpec:
    """The KV cache also holds the MTP head's attention layers (after the main stack's)."""
    if config.speculative_config is None:
        return spec
    return replace(spec, num_layers=spec.num_layers + num_mtp_layers(config.text_config))


def snapshot_reserve_bytes(config: EngineConfig, model: Any, num_slots: int) -> int:
    """Device bytes the recurrent-state snapshot of a full batch takes (rollback.py), kept
    out of the KV cache's share like the probe's activation peak (0 when speculation is off)."""
    if config.speculative_config is None:
        return 0
    rows = [
        t[0].numel() * t.element_size()
        for name, t in model.per_slot_state().items()
        if name.startswith(RECURRENT_PREFIX)
    ]
    return sum(rows) * num_slots


def attach_spec_decoder(executor: PyExecutor, config: EngineConfig) -> SpecDecoder | None:
    """Set up the scheduler and the executor for MTP speculation (None when it is off)."""
    spec: Any = config.speculative_config
    if spec is None:
        return None
    k = spec.num_nextn_predict_layers
    engine = executor.model_engine
    kv = engine.kv_cache_manager
    if kv is None:
        raise RuntimeError("the engine has no KV cache manager yet")
    if getattr(executor.scheduler, "reuse", None) is not None:
        # LlmArgs refuses this first (check_speculative_support); an EngineConfig built by
        # hand still gets the error here, before any step.
        raise ValueError(SPEC_WITH_REUSE_ERROR)
    executor.scheduler.set_draft_len(k)
    drafter = MTPDrafter(
        text_lm(engine.model), kv, engine.tokens_per_block, engine.vocab_size, engine.device
    )
    decoder = SpecDecoder(executor, drafter, k)
    if engine.step_channel is not None:  # the workers run every forward of a step too
        decoder.link = SpecLink(engine.step_channel)
    executor.spec_decoder = decoder
    if config.use_cuda_graph:
        graphs = "the piecewise graphs" if engine.piecewise_graph_runner is not None else "eager"
        logger.warning(
            "speculative_config captures no decode CUDA graph yet: prefill, verify and "
            "rollback steps run in %s (the MTP head's draft passes run eagerly)",
            graphs,
        )
    logger.info(
        "speculative decoding: MTP, %d draft tokens per step (greedy and temperature-only "
        "requests draft)",
        k,
    )
    return decoder
