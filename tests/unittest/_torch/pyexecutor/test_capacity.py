"""Capacity-sized defaults: KV cache from the memory fraction, max_batch_size from what it holds.

The CUDA arithmetic runs on the CPU with the memory queries replaced by fixed figures.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorrt_llm._torch.models.modeling_qwen3_next import RecurrentStateCache
from tensorrt_llm._torch.pyexecutor import kv_cache_creator
from tensorrt_llm._torch.pyexecutor.capacity import (
    MAX_AUTO_BATCH_SIZE_CUDA,
    batch_size_cap,
    recurrent_state_bytes_per_slot,
    size_from_kv,
    size_hybrid_slots,
    typical_request_tokens,
)
from tensorrt_llm._torch.pyexecutor.cuda_graph_runner import graph_batch_sizes
from tensorrt_llm._torch.pyexecutor.kv_cache_creator import (
    KVCacheSpec,
    choose_num_blocks,
    kv_bytes_per_token,
)
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm.inputs.registry import create_input_processor, load_hf_config
from tensorrt_llm.llmapi.llm_args import CudaGraphConfig, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

GiB = 2**30
SPEC = KVCacheSpec(num_layers=36, num_kv_heads=8, head_dim=128, dtype=torch.float8_e4m3fn)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """torch.cuda's memory queries as seen by kv_cache_creator, with settable free bytes."""
    state = {"free": 100 * GiB, "emptied": 0}

    def empty_cache() -> None:
        state["emptied"] += 1

    monkeypatch.setattr(kv_cache_creator.torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(
        kv_cache_creator.torch.cuda, "mem_get_info", lambda device=None: (state["free"], 141 * GiB)
    )
    return state


def test_gpu_kv_cache_takes_the_fraction_of_what_is_left(fake_gpu: dict[str, int]) -> None:
    per_block = kv_bytes_per_token(SPEC) * 32
    cuda = torch.device("cuda")
    blocks = choose_num_blocks(SPEC, cuda, 32, 8, 128, 0.9, None, activation_peak_bytes=10 * GiB)
    assert blocks == int(90 * GiB * 0.9) // per_block  # not 8 x 128 blocks (batch x seq)
    assert fake_gpu["emptied"] == 1  # freed memory is returned before it is measured
    capped = choose_num_blocks(SPEC, cuda, 32, 8, 128, 0.9, 4096, activation_peak_bytes=0)
    assert capped == 4096 // 32
    fake_gpu["free"] = 64 * 2**20
    with pytest.raises(RuntimeError, match="one max_seq_len sequence"):
        choose_num_blocks(SPEC, cuda, 32, 8, 128, 0.9, None)


def test_cpu_kv_cache_is_a_full_batch() -> None:
    assert choose_num_blocks(SPEC, torch.device("cpu"), 32, 8, 128, 0.9, None) == 8 * 128
    assert choose_num_blocks(SPEC, torch.device("cpu"), 32, 8, 128, 0.9, 320) == 10


def test_batch_size_from_the_kv_cache() -> None:
    typical = typical_request_tokens(9000)
    assert typical == 2048 and typical_request_tokens(1000) == 1000
    roomy = size_from_kv(512, num_blocks=100_000, tokens_per_block=32, typical_tokens=2048)
    assert (roomy.max_batch_size, roomy.bound) == (512, "cap")
    tight = size_from_kv(512, num_blocks=1000, tokens_per_block=32, typical_tokens=2048)
    assert (tight.max_batch_size, tight.bound) == (15, "kv cache")
    assert "32000 tokens" in tight.describe() and "max_batch_size 15" in tight.describe()
    assert batch_size_cap(None, torch.device("cuda")) == MAX_AUTO_BATCH_SIZE_CUDA
    assert batch_size_cap(None, torch.device("cpu")) == 8
    assert batch_size_cap(3, torch.device("cuda")) == 3


def test_hybrid_slots_share_memory_with_the_kv_cache() -> None:
    state, kv = 151 * 2**20, 64 * 1024  # Qwen3.6-27B: MiB of state per slot, bytes of KV/token
    sizing = size_hybrid_slots(512, 130 * GiB, 54 * GiB, 0.9, state, kv, 2048)
    usable = (130 * GiB * 0.9 - 54 * GiB) * 0.9
    assert sizing.max_batch_size == int(usable // (state + 2048 * kv))
    assert sizing.bound == "recurrent state" and sizing.max_batch_size < 512
    assert size_hybrid_slots(8, 130 * GiB, GiB, 0.9, state, kv, 2048).bound == "cap"
    with pytest.raises(RuntimeError, match="recurrent state"):
        size_hybrid_slots(512, 50 * GiB, 54 * GiB, 0.9, state, kv, 2048)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_state_bytes_match_the_state_cache(tmp_path: Path, family: str, tp_size: int) -> None:
    """Per rank under tensor parallelism: the rank's DeltaNet heads and conv channels."""
    from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet
    from tensorrt_llm.mapping import Mapping

    config = load_hf_config(write_tiny_checkpoint(family, tmp_path))
    text = getattr(config, "text_config", None) or config
    mapping = Mapping(world_size=tp_size, rank=tp_size - 1, tp_size=tp_size)
    layers = [
        GatedDeltaNet.from_config(text, torch.bfloat16, mapping=mapping)
        for t in text.layer_types
        if t == "linear_attention"
    ]
    cache = RecurrentStateCache(layers, max_num_seq_slots=3, dtype=torch.bfloat16)
    per_row = sum(b.numel() * b.element_size() for b in cache.buffers()) // 4
    assert recurrent_state_bytes_per_slot(text, torch.bfloat16, tp_size) == per_row > 0


def test_graph_buckets_cover_the_default_cap() -> None:
    sizes = graph_batch_sizes(CudaGraphConfig(), 512)
    assert sizes[-1] == 512 and 384 in sizes
    gaps = [b / a for a, b in zip(sizes, sizes[1:], strict=False) if a >= 256]
    assert max(gaps) <= 1.25  # a batch never pads to more than 25% extra rows past 256


def test_default_llm_args_size_the_batch_at_startup(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    assert LlmArgs(model=ckpt).max_batch_size is None
    proc = create_input_processor(ckpt)
    executor = create_py_executor(LlmArgs(model=ckpt, device="cpu").to_engine_config(), proc)
    try:
        assert executor.scheduler.max_batch_size == 8  # the CPU default
        assert executor.get_stats().num_total_seq_slots == 8
    finally:
        executor.shutdown()
    # A shut-down executor lets go of the model and the KV cache (they hold device memory).
    assert executor.kv_cache_manager is None and executor.model_engine is None
    assert executor.get_stats().num_total_seq_slots == 8


@pytest.mark.gpu
def test_gpu_default_batch_is_capacity_sized(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    proc = create_input_processor(ckpt)
    args = LlmArgs(model=ckpt, device="cuda", max_seq_len=1024)
    executor = create_py_executor(args.to_engine_config(), proc)
    try:
        # A tiny model on a big GPU: the KV cache holds far more than 512 typical requests.
        assert executor.scheduler.max_batch_size == MAX_AUTO_BATCH_SIZE_CUDA
        kv = executor.kv_cache_manager
        assert kv.num_blocks * args.tokens_per_block >= 512 * 1024
        graphs = executor.model_engine.cuda_graph_runner
        assert max(graphs.batch_sizes) == MAX_AUTO_BATCH_SIZE_CUDA
        del kv, graphs  # this test's own references
    finally:
        executor.shutdown()
    free, total = torch.cuda.mem_get_info()
    assert free > 0.5 * total  # the shut-down executor's KV cache went back to the device


def test_too_short_max_seq_len_for_an_image_is_a_clear_error(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen2_vl", tmp_path))
    proc = create_input_processor(ckpt)
    args = LlmArgs(model=ckpt, device="cpu", max_seq_len=17)
    with pytest.raises(ValueError, match="max_seq_len=17 cannot hold the smallest image prompt"):
        create_py_executor(args.to_engine_config(), proc)


@pytest.mark.parametrize(
    ("family", "checkpoint", "args"),
    [
        ("qwen3_5_moe", {}, {"load_format": "dummy", "quantization": "fp8_block"}),
        ("qwen3_5_moe", {"quantization": "fp8_block"}, {}),  # an -FP8 release's layout
        ("qwen3_5", {}, {"quantization": "fp8"}),
        (
            "qwen3_5",
            {"mtp_num_hidden_layers": 1},
            {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2}},
        ),
    ],
)
def test_hybrid_presizing_counts_the_weights_as_served(
    tmp_path: Path, family: str, checkpoint: dict, args: dict
) -> None:
    """The weight bytes the hybrid presizing subtracts (`served_weight_bytes`, a meta build)
    equal the built model's: FP8 linears and experts at one byte a weight, the MTP head
    included. The 16-bit build dtype counted an FP8 model twice."""
    from tensorrt_llm._torch.models.modeling_auto import get_model_class
    from tensorrt_llm._torch.pyexecutor.model_build import (
        build_model,
        model_config_of,
        served_weight_bytes,
    )

    ckpt = write_tiny_checkpoint(family, tmp_path / "ckpt", **checkpoint)
    config = LlmArgs(model=str(ckpt), device="cpu", max_batch_size=2, **args).to_engine_config()
    cls = get_model_class(config.architecture)
    model_config = model_config_of(config)
    model = build_model(cls, model_config, torch.device("cpu"), config)
    built = sum(p.numel() * p.element_size() for p in model.parameters())
    assert served_weight_bytes(config, cls, model_config) == built
