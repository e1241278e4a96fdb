"""What `create_py_executor` does for MTP speculation: the head before loading, its KV layers,
the scheduler's draft room and the executor's `SpecDecoder` (small hooks in the creator);
under tensor parallelism the decoder's link to the worker ranks (tp_spec.py)."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch import nn

from ...models.modeling_qwen3_5_mtp import num_mtp_layers, with_mtp
from ...models.modeling_qwen3_next import Qwen3_5TextForCausalLM
from ..cuda_graph_runner import graph_batch_sizes
from ..engine_config import CudaGraphConfig
from .config import SPEC_WITH_REUSE_ERROR
from .draft_graphs import DraftGraphRunner
from .mtp_drafter import MTPDrafter
from .rollback import RECURRENT_PREFIX, record_bytes_per_token
from .rollback_graphs import RollbackGraphRunner
from .spec_decoder import SpecDecoder
from .tp_spec import SpecLink
from .verify_graphs import GRAPH_RECORD_BUDGET, VerifyGraphRunner, recorded_buckets

if TYPE_CHECKING:
    from ..engine_config import EngineConfig
    from ..kv_cache_creator import KVCacheSpec
    from ..model_engine import PyTorchModelEngine
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


def verify_tokens_per_request(config: EngineConfig) -> int:
    """The tokens a request verifies in a step: its last one and its drafts (1 without
    speculation); the engine's buffers hold that many generation rows a request."""
    spec: Any = config.speculative_config
    return 1 if spec is None else 1 + spec.num_nextn_predict_layers


# Whether MTP verify steps replay their own CUDA graphs (verify_graphs.py) unless the
# environment says (`VERIFY_GRAPHS_ENV`; 0 runs them in the piecewise graphs, as before).
VERIFY_GRAPHS_DEFAULT = True
VERIFY_GRAPHS_ENV = "TRTLLM_MTP_VERIFY_GRAPHS"
# 1: verify graphs only for the buckets whose rollback records fit (verify_graphs.py); the
# others run as chunks. An A/B knob until measured at c = 24-48 (Qwen3.6-27B's unrecorded
# buckets): a graph without records replays a whole forward for any rejected draft.
VERIFY_RECORDED_ONLY_DEFAULT = False
VERIFY_RECORDED_ONLY_ENV = "TRTLLM_MTP_VERIFY_GRAPHS_RECORDED_ONLY"
# The draft passes after a step of full verify rows as CUDA graphs (draft_graphs.py; 0 runs
# them eagerly): the 27B rejected-draft step 39.6 -> 34.9 ms on an H100 (qwen3_6_27b_h200.md).
DRAFT_GRAPHS_DEFAULT = True
DRAFT_GRAPHS_ENV = "TRTLLM_MTP_DRAFT_GRAPHS"
# The rollback after a verify-graph step as CUDA graphs (rollback_graphs.py; 0 runs it eagerly):
# the 27B rejected-draft step 37.5 -> 26.2 ms on an H100 (qwen3_6_27b_h200.md).
ROLLBACK_GRAPHS_DEFAULT = True
ROLLBACK_GRAPHS_ENV = "TRTLLM_MTP_ROLLBACK_GRAPHS"


def _switch(env: str, default: bool) -> bool:
    """`env`: unset -> `default`, "1" on, "0" off; anything else is an error."""
    value = os.environ.get(env)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{env} must be 0 or 1, got {value!r}")
    return value == "1"


def verify_graphs_enabled() -> bool:
    return _switch(VERIFY_GRAPHS_ENV, VERIFY_GRAPHS_DEFAULT)


def draft_graphs_enabled() -> bool:
    return _switch(DRAFT_GRAPHS_ENV, DRAFT_GRAPHS_DEFAULT)


def rollback_graphs_enabled() -> bool:
    return _switch(ROLLBACK_GRAPHS_ENV, ROLLBACK_GRAPHS_DEFAULT)


def capture_verify_graphs(
    engine: PyTorchModelEngine, config: EngineConfig, batch_sizes: list[int]
) -> None:
    """Capture the verify steps' CUDA graphs (verify_graphs.py) for the decode graphs' batch
    sizes whose rows fit a step; none under tensor parallelism (its steps run piecewise)."""
    per_request = verify_tokens_per_request(config)
    if not verify_graphs_enabled():
        logger.info(
            "MTP verify CUDA graphs are off (%s=0): verify steps run in the piecewise graphs "
            "where they fit",
            VERIFY_GRAPHS_ENV,
        )
        return
    if engine.step_channel is not None:
        logger.warning(
            "speculative_config with tensor_parallel_size > 1 captures no verify CUDA graphs "
            "yet: verify steps run in the piecewise graphs"
        )
        return
    sizes = [b for b in batch_sizes if b * per_request <= config.max_num_tokens]
    if not sizes:
        logger.warning(
            "no verify CUDA graph: %d tokens a request exceed max_num_tokens=%d at every batch "
            "size of %s",
            per_request,
            config.max_num_tokens,
            batch_sizes,
        )
        return
    runner = VerifyGraphRunner(
        engine,
        sizes,
        per_request,
        config.cuda_graph_padding_enabled,
        record_bytes_per_token(engine.model.per_slot_state()),
        recorded_only=_switch(VERIFY_RECORDED_ONLY_ENV, VERIFY_RECORDED_ONLY_DEFAULT),
    )
    if not runner.batch_sizes:
        logger.info("no MTP verify CUDA graph: no batch size's rollback records fit")
        return
    runner.capture_all()
    engine.verify_graph_runner = runner


def snapshot_reserve_bytes(config: EngineConfig, model: Any, num_slots: int) -> int:
    """Device bytes the recurrent-state snapshot of a full batch takes (rollback.py), kept
    out of the KV cache's share like the probe's activation peak (0 when speculation is off),
    plus where CUDA graphs run the verify graphs' rollback records (verify_graphs.py; for
    the batch sizes a full batch may capture, the graphs are sized after the KV cache). The
    rollback graphs hold the full batch's snapshot for good (rollback_graphs.py)."""
    if config.speculative_config is None:
        return 0
    state = model.per_slot_state()
    rows = [
        t[0].numel() * t.element_size() for n, t in state.items() if n.startswith(RECURRENT_PREFIX)
    ]
    records = 0
    if config.use_cuda_graph and verify_graphs_enabled():
        per_request = verify_tokens_per_request(config)
        sizes = config.cuda_graph_batch_sizes or graph_batch_sizes(CudaGraphConfig(), num_slots)
        sizes = [b for b in sizes if b * per_request <= config.max_num_tokens]
        record = per_request * record_bytes_per_token(state)
        records = record * sum(recorded_buckets(sizes, record, GRAPH_RECORD_BUDGET))
    return sum(rows) * num_slots + records


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
    verify = engine.verify_graph_runner
    if verify is not None and draft_graphs_enabled():
        decoder.draft_graphs = DraftGraphRunner(
            drafter,
            verify.batch_sizes,
            k,
            drafter.mtp.hidden_size,
            engine.max_blocks_per_seq,
            engine.use_mrope,
        )
        decoder.draft_graphs.capture_all()
    if verify is not None and verify.recorded and rollback_graphs_enabled():
        rollback = RollbackGraphRunner(decoder.rollback, verify, engine.max_batch_size)
        if rollback.batch_sizes:
            rollback.capture_all()
            decoder.rollback_graphs = rollback
    if engine.step_channel is not None:  # the workers run every forward of a step too
        decoder.link = SpecLink(engine.step_channel)
    executor.spec_decoder = decoder
    if config.use_cuda_graph:
        graphs = "the piecewise graphs" if engine.piecewise_graph_runner is not None else "eager"
        logger.info(
            "speculative_config: verify steps of drafting requests alone replay %s; steps "
            "with prefill chunks or other requests, and rollback forwards, run in %s; the MTP "
            "head's draft passes run %s",
            "the verify CUDA graphs" if verify is not None else "no CUDA graph",
            graphs,
            "in CUDA graphs after a verify graph" if decoder.draft_graphs else "eagerly",
        )
        if decoder.rollback_graphs is not None:
            logger.info(
                "speculative_config: the rollback of verify-graph steps of batch sizes %s "
                "replays CUDA graphs (%s=0 rolls back eagerly)",
                decoder.rollback_graphs.batch_sizes,
                ROLLBACK_GRAPHS_ENV,
            )
    logger.info(
        "speculative decoding: MTP, %d draft tokens per step (greedy and temperature-only "
        "requests draft)",
        k,
    )
    return decoder
