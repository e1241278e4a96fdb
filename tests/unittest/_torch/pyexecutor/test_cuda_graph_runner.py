"""Decode CUDA graphs: replays match eager, read the live mRoPE delta cache, and never sync."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "modeling"))
from vl_parity_helpers import admit, make_request, our_prefill, prompt  # noqa: E402

from tensorrt_llm._torch.config_utils import (  # noqa: E402
    load_pretrained_config,
    resolve_architecture,
)
from tensorrt_llm._torch.models.modeling_auto import get_model_class  # noqa: E402
from tensorrt_llm._torch.models.modeling_utils import ModelConfig  # noqa: E402
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import CUDAGraphRunner  # noqa: E402
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine  # noqa: E402
from tensorrt_llm._torch.pyexecutor.resource_manager import (  # noqa: E402
    KVCacheManager,
    SeqSlotManager,
)
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests  # noqa: E402
from tensorrt_llm._torch.weight_loading import load_model  # noqa: E402
from tensorrt_llm.inputs.registry import create_input_processor  # noqa: E402
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint  # noqa: E402


class _Stack:
    def __init__(self, family: str, root: Path) -> None:
        ckpt = write_tiny_checkpoint(family, root)
        config = load_pretrained_config(ckpt)
        model_config = ModelConfig(
            config,
            torch_dtype=torch.float32,
            attn_backend="triton",
            max_num_seq_slots=8,
            checkpoint_dir=str(ckpt),
        )
        model = load_model(get_model_class(resolve_architecture(config)), model_config, "cuda")
        self.engine = PyTorchModelEngine(
            model,
            torch.device("cuda"),
            512,
            8,
            512,
            16,
        )
        text = config.text_config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.kv = KVCacheManager(
            text.num_hidden_layers,
            text.num_key_value_heads,
            head_dim,
            16,
            128,
            32,
            dtype=torch.float32,
            device="cuda",
        )
        self.engine.set_kv_cache_manager(self.kv)
        self.slots = SeqSlotManager(8)
        self.processor = create_input_processor(ckpt)


def _eager(engine: PyTorchModelEngine, reqs: list) -> torch.Tensor:
    """The eager result of a decode step, leaving recurrent (DeltaNet) state as it was.

    NOTE: a KV write is idempotent, a recurrent-state update is not: without the restore the
    graph replay of the same step would advance the state a second time.
    """
    saved = {n: b.clone() for n, b in engine.model.named_buffers() if "recurrent_states" in n}
    runner, engine.cuda_graph_runner = engine.cuda_graph_runner, None
    try:
        return engine.forward(ScheduledRequests([], reqs)).float().clone()
    finally:
        engine.cuda_graph_runner = runner
        buffers = dict(engine.model.named_buffers())
        for name, value in saved.items():
            buffers[name].copy_(value)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl", "qwen3_5", "qwen3_vl_moe"])
def test_graph_replays_match_eager_with_changing_batches(family: str, tmp_path: Path) -> None:
    stack = _Stack(family, tmp_path)
    engine = stack.engine
    engine.cuda_graph_runner = CUDAGraphRunner(engine, [2, 4])
    reqs = []
    for rid, kind in enumerate(("image", "video", "text")):
        req = make_request(stack, rid, prompt(kind))
        admit(stack, req, extra_tokens=32)
        req.add_new_token(int(our_prefill(stack, req).argmax()))
        reqs.append(req)
    # The deltas differ, so a graph that read a stale or wrong slot would diverge.
    deltas = {int(engine.model.mrope_position_deltas_cache[r.seq_slot]) for r in reqs}
    assert len(deltas) > 1
    for step in range(6):
        live = reqs if step < 3 else reqs[1:]  # the batch shrinks: same bucket, new rows
        expected = _eager(engine, live)
        got = engine.forward(ScheduledRequests([], live)).float()
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
        for req, row in zip(live, got, strict=True):
            req.add_new_token(int(row.argmax()))
    assert set(engine.cuda_graph_runner.graphs) == {4, 2}


@pytest.mark.gpu
def test_steady_decode_does_not_sync(tmp_path: Path) -> None:
    stack = _Stack("qwen2_vl", tmp_path)
    engine = stack.engine
    engine.cuda_graph_runner = CUDAGraphRunner(engine, [4])
    reqs = []
    for rid, kind in enumerate(("image", "text", "text")):
        req = make_request(stack, rid, prompt(kind))
        admit(stack, req, extra_tokens=32)
        req.add_new_token(int(our_prefill(stack, req).argmax()))
        reqs.append(req)
    engine.forward(ScheduledRequests([], reqs))  # captures the graph
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(8):
            out = engine.forward(ScheduledRequests([], reqs))
            for req in reqs:
                req.add_new_token(1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert out.shape[0] == 3
