"""Host-side time to prepare one decode step for 64 generation requests (CPU).

Builds a tiny Qwen2-VL engine, prefills 64 image requests, then times `engine.prepare` (host arrays,
pinned copies, AttentionMetadata) for a pure-generation step. Target: < 1 ms per step.

    python benchmarks/bench_prepare_step.py [--requests 64] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ckpt = write_tiny_checkpoint("qwen2_vl", tempfile.mkdtemp())
    config = load_pretrained_config(ckpt)
    n = args.requests
    model = load_model(
        get_model_class(resolve_architecture(config)),
        ModelConfig(config, max_num_seq_slots=n, checkpoint_dir=str(ckpt)),
        "cpu",
    )
    engine = PyTorchModelEngine(model, torch.device("cpu"), 4096, n, 1024, 32)
    text = config.text_config
    kv = KVCacheManager(
        text.num_hidden_layers,
        text.num_key_value_heads,
        text.hidden_size // text.num_attention_heads,
        32,
        n * 8,
        32,
        dtype=torch.float32,
    )
    engine.set_kv_cache_manager(kv)
    proc = create_input_processor(ckpt)
    reqs = []
    for i in range(n):
        ids, extra = proc({"prompt": f"request number {i} says hello"}, None)
        req = LlmRequest(i, ids, multimodal_params=MultimodalParams(extra["multimodal_data"]))
        req.seq_slot = i
        kv.add_tokens(i, req.prompt_len + 64)
        req.context_chunk_size = req.prompt_len
        engine.forward(ScheduledRequests([req], []))
        req.add_new_token(1)
        reqs.append(req)
    step = ScheduledRequests([], reqs)
    for _ in range(20):
        engine.build_batch(step)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        engine.build_batch(step)
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    print(f"requests={n} iters={args.iters}")
    print(
        f"prepare per decode step: median {statistics.median(times):.3f} ms, "
        f"p90 {times[int(0.9 * len(times))]:.3f} ms, min {times[0]:.3f} ms"
    )


if __name__ == "__main__":
    main()
