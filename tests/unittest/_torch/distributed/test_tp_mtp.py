"""MTP speculative decoding under tensor parallelism (2 gloo ranks, tiny Qwen3.5 dense and
MoE checkpoints with MTP weights): each rank loads its slices of the MTP head, and greedy
speculative output through the engine equals the non-speculative TP=1 output token for
token, through batching, chunked prefill, the overlap executor and recurrent rollback on
every rank (the workers' rollback is load-bearing: a control without it changes the output).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tp_harness import spawn_ranks
from tp_mtp_bodies import mtp_tp_runs

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.distributed import kv_head_shard
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.pyexecutor.spec_decode.mtp_drafter import DraftPlan
from tensorrt_llm._torch.pyexecutor.spec_decode.setup import prepare_mtp, text_lm
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2
FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("tp_mtp"))
    return {f: write_tiny_checkpoint(f, root / f, mtp_num_hidden_layers=1) for f in FAMILIES}


def _half(t: torch.Tensor, rank: int, dim: int = 0) -> torch.Tensor:
    return t.chunk(WORLD, dim=dim)[rank]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("rank", [0, 1])
def test_rank_loads_its_slices_of_the_mtp_head(
    family: str, rank: int, ckpts: dict[str, Path]
) -> None:
    ckpt = ckpts[family]
    full = load_file(str(ckpt / "model.safetensors"))
    config = load_pretrained_config(ckpt)
    mapping = Mapping(world_size=WORLD, rank=rank, tp_size=WORLD)
    model = load_model(
        get_model_class(config.tllm_architecture),
        ModelConfig(config, checkpoint_dir=str(ckpt), mapping=mapping),
        "cpu",
        prepare=lambda m: prepare_mtp(m, "vanilla"),
    )
    mtp: Any = text_lm(model).mtp
    layer = mtp.layers[0]
    pre = "mtp.layers.0."

    def same(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, rtol=0, atol=0)

    # Half the query heads (with their gates) and one of the two kv heads.
    attn = layer.self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    kv_rows, _ = kv_head_shard(2, attn.head_dim, WORLD, rank)
    qkv = [_half(full[pre + "self_attn.q_proj.weight"], rank)]
    qkv += [kv_rows.take(full[f"{pre}self_attn.{p}_proj.weight"]) for p in ("k", "v")]
    same(attn.qkv_proj.weight, torch.cat(qkv))
    same(attn.o_proj.weight, _half(full[pre + "self_attn.o_proj.weight"], rank, dim=1))
    mlp = layer.mlp
    if family == "qwen3_5":
        gate_up = [_half(full[f"{pre}mlp.{p}_proj.weight"], rank) for p in ("gate", "up")]
        same(mlp.gate_up_proj.weight, torch.cat(gate_up))
        same(mlp.down_proj.weight, _half(full[pre + "mlp.down_proj.weight"], rank, dim=1))
    else:  # experts 2r, 2r + 1 whole; the shared expert tensor-parallel; the router whole
        for j in range(2):
            e = f"{pre}mlp.experts.{2 * rank + j}."
            want = torch.cat([full[e + "gate_proj.weight"], full[e + "up_proj.weight"]])
            same(mlp.experts.gate_up_proj[j], want)
            same(mlp.experts.down_proj[j], full[e + "down_proj.weight"])
        s = pre + "mlp.shared_expert."
        gate_up = [_half(full[f"{s}{p}_proj.weight"], rank) for p in ("gate", "up")]
        same(mlp.shared_expert.gate_up_proj.weight, torch.cat(gate_up))
        same(mlp.shared_expert.down_proj.weight, _half(full[s + "down_proj.weight"], rank, dim=1))
        same(mlp.gate.weight, full[pre + "mlp.gate.weight"])
    # fc (replicated) and the norms are whole on every rank.
    same(mtp.fc.weight, full["mtp.fc.weight"])
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        same(getattr(mtp, name).weight, full[f"mtp.{name}.weight"])
    same(layer.input_layernorm.weight, full[pre + "input_layernorm.weight"])


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_mtp_greedy_equals_tp1(family: str, ckpts: dict[str, Path]) -> None:
    rank0, worker = spawn_ranks(mtp_tp_runs, WORLD, str(ckpts[family]), timeout_s=600)
    reference = rank0["reference"]
    assert [len(o) for o in reference] == [13, 9, 17, 6]
    tp1_out, tp1_stats = rank0["tp1"]
    head_out, head_stats = rank0["head"]
    partly_out, partly_stats = rank0["partly"]
    assert tp1_out == reference
    assert head_out == reference
    assert partly_out == reference
    # The head's drafts under TP=2 are TP=1's (random weights: almost all rejected).
    assert head_stats == tp1_stats
    assert head_stats["num_draft_tokens"] > head_stats["num_verify_rows"] > 0
    assert head_stats["num_replays"] > 0
    # Partly correct drafts: some accepted, rows rolled back by different lengths.
    assert 0 < partly_stats["num_accepted_tokens"] < partly_stats["num_draft_tokens"]
    assert partly_stats["num_replays"] > 0
    assert all(parts > 0 for parts in worker)


def test_tp2_without_the_workers_rollback_the_output_changes(ckpts: dict[str, Path]) -> None:
    """The control: rank 0 rolls back, the worker replays without restoring its rows."""
    rank0, _ = spawn_ranks(mtp_tp_runs, WORLD, str(ckpts["qwen3_5"]), True, timeout_s=600)
    partly_out, _ = rank0["partly"]
    assert partly_out != rank0["reference"]


def test_draft_plan_travels_whole() -> None:
    """What a worker's passes read is rank 0's plan, field for field."""
    table = np.array([[3, 7, -1], [5, 2, 9]], dtype=np.int64)
    plan = DraftPlan(
        offsets=np.array([0, 4]),
        lens=np.array([4, 2]),
        starts=np.array([12, 30]),
        num_drafts=np.array([0, 3]),
        seq_slots=np.array([1, 0]),
        num_blocks=np.array([2, 3]),
        block_table=table,
        next_ids=np.arange(100, 106),
    )
    got = DraftPlan.unpack(plan.pack(), plan.num_rows, table.shape[1])
    for field in dataclasses.fields(DraftPlan):
        assert np.array_equal(getattr(got, field.name), getattr(plan, field.name)), field.name


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_nccl_mtp_greedy_equals_tp1(ckpts: dict[str, Path]) -> None:
    """NCCL: the draft tokens of each pass are broadcast as device tensors (no host copy)."""
    from tensorrt_llm import LLM, SamplingParams

    kwargs = dict(device="cuda", dtype="float32", cuda_graph_config=None, max_batch_size=2)
    kwargs.update(max_num_tokens=16)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = ["hello there", "a longer prompt " * 6, "short"]
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    for family in FAMILIES:
        ckpt = str(ckpts[family])
        with LLM(ckpt, **kwargs) as llm:
            reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        with LLM(ckpt, tensor_parallel_size=2, speculative_config=mtp, **kwargs) as llm:
            outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        assert outputs == reference, family
