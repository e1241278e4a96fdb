"""Tensor parallelism on 2 GPUs over NCCL: the module-level logits and the LLM API's greedy
tokens equal TP=1's (float32). CUDA graphs are refused with tensor_parallel_size > 1 for now,
so these run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_bodies import schedule_logits
from tp_harness import spawn_ranks

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


# qwen3_5 / qwen3_5_moe: the hybrid stacks, whose DeltaNet Triton kernels run on the rank's
# heads and channels.
@pytest.mark.parametrize("family", ["qwen3", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe"])
def test_tp2_nccl_logits_equal_tp1(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    results = spawn_ranks(schedule_logits, 2, str(ckpt), True, device_type="cuda")
    for rank, result in enumerate(results):
        pairs = zip(result["reference"], result["sharded"], strict=True)
        for step, (ref, got) in enumerate(pairs):
            msg = f"rank {rank} step {step}"
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=msg)
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), msg


def test_llm_tp2_cuda_greedy_equals_tp1(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "qwen3"))
    kwargs = dict(device="cuda", dtype="float32", cuda_graph_config=None, max_batch_size=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = ["hello there", "a longer prompt " * 8, "short"]
    with LLM(ckpt, **kwargs) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    with LLM(ckpt, tensor_parallel_size=2, **kwargs) as llm:
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    assert outputs == reference


def test_cuda_graphs_with_tp_are_refused(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "qwen3"))
    with pytest.raises(ValueError, match="CUDA graphs"):
        LLM(ckpt, device="cuda", tensor_parallel_size=2)
