"""Block-FP8 checkpoints at tensor_parallel_size=2 (2 gloo ranks, float32 on the CPU: the
torch reference GEMM). Each rank's e4m3 weights and weight_scale_inv are exactly the TP=1
layer's slices (column shards: out-block rows of the scales, row shards: in-block columns;
fused qkv / gate_up per part), greedy tokens equal TP=1's, and a shard that would split a
128-block is refused before any rank starts, naming the layer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_bodies import fp8_block_layers
from tp_engine_bodies import MAX_TOKENS, PROMPTS, greedy_tp1_and_tp
from tp_harness import spawn_ranks

from tensorrt_llm._torch.pyexecutor.tp_setup import check_model_shards
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

BLOCK = 128
# Per rank: 2 query heads and 1 kv head of 128 dims, 128 MLP channels: whole 128-blocks.
ALIGNED = dict(hidden_size=128, head_dim=128, intermediate_size=256)


def _fp8(tmp_path: Path, family: str = "qwen3", **dims: object) -> Path:
    return write_tiny_checkpoint(family, tmp_path / family, quantization="fp8_block", **dims)


# qkv: q (512) k (256) v (256) rows; gate_up: gate (256) up (256) rows.
COLUMN_PARTS = {"qkv_proj": (512, 256, 256), "gate_up_proj": (256, 256)}


def _expected_slice(
    name: str, weight: torch.Tensor, scale: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s slice of the TP=1 (weight, scales) of layer `name`, by hand."""
    leaf = name.rpartition(".")[2]
    if leaf in ("o_proj", "down_proj"):  # row-parallel: half the columns, half the blocks
        k = weight.shape[1] // 2
        cols = slice(rank * k, (rank + 1) * k)
        blocks = slice(rank * k // BLOCK, (rank + 1) * k // BLOCK)
        return weight[:, cols], scale[:, blocks]
    # Column-parallel: half of each fused part's rows, concatenated per rank.
    row, weights, scales = 0, [], []
    for size in COLUMN_PARTS[leaf]:
        start = row + rank * (size // 2)
        end = start + size // 2
        weights.append(weight[start:end])
        scales.append(scale[start // BLOCK : end // BLOCK])
        row += size
    return torch.cat(weights), torch.cat(scales)


def test_tp2_fp8_block_shards_are_the_tp1_slices(tmp_path: Path) -> None:
    ckpt = _fp8(tmp_path, **ALIGNED)
    per_rank = spawn_ranks(fp8_block_layers, 2, str(ckpt))
    for rank, result in enumerate(per_rank):
        single, sharded = result["single"], result["sharded"]
        assert set(sharded) == set(single) and len(single) == 8  # 4 linears x 2 layers
        for name, (weight, scale, block) in sharded.items():
            assert block == (BLOCK, BLOCK), name
            want_w, want_s = _expected_slice(name, single[name][0], single[name][1], rank)
            assert torch.equal(weight, want_w), f"{name} rank {rank} weight"
            assert torch.equal(scale, want_s), f"{name} rank {rank} scales"


def test_tp2_fp8_block_greedy_equals_tp1(tmp_path: Path) -> None:
    ckpt = _fp8(tmp_path, **ALIGNED)
    (reference, sharded), worker_steps = spawn_ranks(greedy_tp1_and_tp, 2, str(ckpt), False)
    assert len(reference) == len(PROMPTS)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert sharded == reference
    assert worker_steps > 0


def test_tp2_fp8_block_quantized_on_load_greedy_equals_tp1(tmp_path: Path) -> None:
    # quantization="fp8_block" on a 16-bit checkpoint: each rank quantizes its own slices,
    # whole blocks of the full weight, so its e4m3 values and scales are TP=1's.
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "bf16", **ALIGNED)
    quant = {"quantization": "fp8_block"}
    (reference, sharded), _ = spawn_ranks(greedy_tp1_and_tp, 2, str(ckpt), False, quant)
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert sharded == reference


def test_a_shard_that_splits_a_block_is_refused(tmp_path: Path) -> None:
    # 128 MLP channels: 64 a rank, half a 128-block of gate_up's scales.
    ckpt = _fp8(tmp_path, hidden_size=128, head_dim=128, intermediate_size=128)
    config = LlmArgs(model=str(ckpt), device="cpu", tensor_parallel_size=2).to_engine_config()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_up_proj: .*\[0, 64\)"):
        check_model_shards(config)


# Qwen3-VL-MoE with 128-dim heads: attention shards whole blocks, the 4 experts split 2 a rank
# (expert parallelism: whole experts with their scales), the vision tower stays 16-bit.
MOE_ALIGNED = dict(
    text_config={
        "hidden_size": 128,
        "head_dim": 128,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    },
    vision_config={"out_hidden_size": 128},
)


def test_tp2_fp8_block_moe_vl_greedy_equals_tp1(tmp_path: Path) -> None:
    ckpt = _fp8(tmp_path, "qwen3_vl_moe", **MOE_ALIGNED)
    (reference, sharded), _ = spawn_ranks(greedy_tp1_and_tp, 2, str(ckpt), True)
    assert len(reference) == len(PROMPTS) + 2
    assert sharded == reference
