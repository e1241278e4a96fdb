"""One all-reduce per MoE layer under expert parallelism: the tensor-parallel shared expert's
partial output joins the routed partial sum before the single reduce. On 2 gloo ranks the
tiny qwen3_5_moe (a shared expert on every MoE layer) gives the TP=1 logits and greedy
tokens of a chunked-prefill + decode schedule, with exactly one all-reduce inside each MoE
block call (counted on `torch.distributed.all_reduce`, which every collective goes through)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tp_bodies import NUM_DECODE, PROMPTS, _manager, text_lm
from tp_harness import spawn_ranks

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.fused_moe import MoE
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

WORLD = 2


def _counted_run(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    from paged_kv_helpers import chunked_schedule, run_schedule

    device = torch.device("cpu")
    config = load_pretrained_config(checkpoint_dir)
    cls = get_model_class(config.tllm_architecture)
    base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)
    single = text_lm(load_model(cls, base, device))
    sharded = text_lm(load_model(cls, replace(base, mapping=mapping), device))
    blocks = [m for m in sharded.modules() if isinstance(m, MoE)]
    assert blocks and all(b.shared_expert is not None for b in blocks)
    assert all(b.local_experts is not None for b in blocks)
    calls = {"n": 0}
    per_block: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real_all_reduce(*args, **kwargs)

    def counted(block: MoE) -> None:
        forward = block.forward

        def wrapper(x: torch.Tensor) -> torch.Tensor:
            before = calls["n"]
            out = forward(x)
            per_block.append(calls["n"] - before)
            return out

        block.forward = wrapper  # type: ignore[method-assign]

    for block in blocks:
        counted(block)
    vocab = int(single.config.vocab_size)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, vocab, (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS]
    schedule = chunked_schedule(PROMPTS, chunked=2, num_decode=NUM_DECODE)
    reference = run_schedule(single, _manager(single, device), sequences, schedule, device=device)
    dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
    try:
        got = run_schedule(sharded, _manager(sharded, device), sequences, schedule, device=device)
    finally:
        dist.all_reduce = real_all_reduce  # type: ignore[assignment]
    return {"reference": reference, "sharded": got, "per_block": per_block}


def test_tp2_shared_expert_moe_one_all_reduce_per_layer(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3_5_moe", tmp_path / "qwen3_5_moe")
    for rank, result in enumerate(spawn_ranks(_counted_run, WORLD, str(ckpt))):
        assert result["per_block"] and set(result["per_block"]) == {1}, f"rank {rank}"
        pairs = zip(result["reference"], result["sharded"], strict=True)
        for step, (ref, got) in enumerate(pairs):
            msg = f"rank {rank} step {step}"
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5, msg=msg)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), msg  # the greedy tokens
