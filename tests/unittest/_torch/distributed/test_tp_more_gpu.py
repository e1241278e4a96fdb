"""Issue 21's leftovers on 2 GPUs (NCCL): the KV cache follows the GPU with less free memory,
block-FP8 checkpoints shard with their scales on the CUDA GEMMs, and a real `torchrun
--nproc_per_node 2` of one script serves from rank 0; each compared with TP=1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrun_script import generate

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.pyexecutor.kv_cache_creator import KVCacheSpec, kv_bytes_per_token
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["hello there", "a longer prompt " * 8, "short"]
# A small share of an H200, so the tiny model's cache stays a few 100k blocks.
FRACTION = 0.02


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


def test_kv_blocks_follow_the_gpu_with_less_free_memory(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "qwen3"))
    kwargs = dict(
        device="cuda",
        dtype="float32",
        cuda_graph_config=None,
        max_batch_size=4,
        max_seq_len=512,
        kv_cache_free_gpu_memory_fraction=FRACTION,
    )
    with LLM(ckpt, **kwargs) as llm:
        reference = _tokens(llm)
    # Hold 60 % of GPU 1 in this process: rank 1 has far less free memory than rank 0.
    free1, _ = torch.cuda.mem_get_info(1)
    hold = torch.empty(int(free1 * 0.6), dtype=torch.uint8, device="cuda:1")
    try:
        left1, _ = torch.cuda.mem_get_info(1)
        free0, _ = torch.cuda.mem_get_info(0)
        with LLM(ckpt, tensor_parallel_size=2, **kwargs) as llm:
            blocks = llm._executor.info.kv_limits.num_blocks
            outputs = _tokens(llm)
    finally:
        del hold
        torch.cuda.empty_cache()
    config = load_pretrained_config(ckpt)
    spec = KVCacheSpec.from_text_config(config, torch.float32, tp_size=2)
    per_block = kv_bytes_per_token(spec) * 32
    assert blocks * per_block <= left1 * FRACTION  # what rank 1 can hold, not rank 0
    assert blocks * per_block < 0.6 * free0 * FRACTION
    assert outputs == reference


def test_fp8_block_tp2_cuda_greedy_equals_tp1(tmp_path: Path) -> None:
    # Whole 128-blocks per rank (test_tp_fp8_block.py's dims); bf16 on the block-FP8 GEMMs.
    ckpt = str(
        write_tiny_checkpoint(
            "qwen3",
            tmp_path / "fp8",
            quantization="fp8_block",
            hidden_size=128,
            head_dim=128,
            intermediate_size=256,
        )
    )
    kwargs = dict(device="cuda", dtype="bfloat16", cuda_graph_config=None, max_batch_size=4)
    with LLM(ckpt, **kwargs) as llm:
        reference = _tokens(llm)
    with LLM(ckpt, tensor_parallel_size=2, **kwargs) as llm:
        outputs = _tokens(llm)
    assert outputs == reference


def test_torchrun_nproc2_serves_from_rank0(tmp_path: Path) -> None:
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "qwen3"))
    reference = generate(ckpt, 1, "cuda")
    script = Path(__file__).with_name("torchrun_script.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "0",
            str(script),
            ckpt,
            "2",
            "cuda",
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, run.stdout  # rank 1 ended inside LLM(...)
    assert json.loads(lines[0].removeprefix("TOKENS ")) == reference
