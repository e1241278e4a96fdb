"""What each rank runs in the tensor-parallel tests (importable by spawned processes)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.mapping import Mapping

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from paged_kv_helpers import FakeKVCacheManager, chunked_schedule, run_schedule  # noqa: E402

PROMPTS = [7, 5, 11]
NUM_DECODE = 6


def text_lm(model: torch.nn.Module) -> Any:
    """The causal LM of a checkpoint's model (the `llm` of a VL model)."""
    return getattr(model, "llm", model)


def _first_attention(lm: Any) -> Any:
    """The first attention module of the stack (a hybrid stack starts with DeltaNet layers)."""
    return next(layer.self_attn for layer in lm.model.layers if hasattr(layer, "self_attn"))


def _manager(lm: Any, device: torch.device, seed: int = 0) -> FakeKVCacheManager:
    layers = lm.model.layers
    attn = _first_attention(lm)
    return FakeKVCacheManager(
        len(layers), 32, 4, attn.num_kv_heads, attn.head_dim, seed=seed, device=device
    )


def _run(lm: Any, device: torch.device, sequences: Any, schedule: Any) -> list[torch.Tensor]:
    logits = run_schedule(lm, _manager(lm, device), sequences, schedule, device=device)
    return [t.cpu() for t in logits]


def schedule_logits_all(mapping: Mapping, checkpoint_dirs: list[str]) -> list[dict[str, Any]]:
    """`schedule_logits` of several checkpoints in one spawn (spawning costs seconds)."""
    return [schedule_logits(mapping, d) for d in checkpoint_dirs]


def schedule_logits_as_built(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    """`schedule_logits` of the models the engine builds (`build_model`: a block-FP8
    checkpoint's layers switched to FP8 before its weights load), on CPU."""
    from tensorrt_llm._torch.pyexecutor.model_build import build_model, model_config_of
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    config = LlmArgs(model=checkpoint_dir, device="cpu", max_batch_size=2).to_engine_config()
    cls = get_model_class(config.architecture)
    device = torch.device("cpu")

    def build(on: Mapping) -> Any:
        engine_config = replace(config, mapping=on)
        return text_lm(build_model(cls, model_config_of(engine_config), device, engine_config))

    return schedule_logits(mapping, checkpoint_dir, build=build)


def schedule_logits(
    mapping: Mapping, checkpoint_dir: str, on_gpu: bool = False, build: Any = None
) -> dict[str, Any]:
    """The TP=1 and this rank's TP=N logits of one chunked-prefill + decode schedule (the
    same token sequences and KV block order for both), plus the shard sizes built; with
    `on_gpu`, on this rank's GPU (the collectives then run over NCCL). `build(mapping)`:
    the text LM to run (default: `load_model` of the checkpoint)."""
    device = torch.device("cuda", mapping.local_rank) if on_gpu else torch.device("cpu")
    if build is None:
        config = load_pretrained_config(checkpoint_dir)
        cls = get_model_class(config.tllm_architecture)
        base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)

        def build(on: Mapping) -> Any:
            return text_lm(load_model(cls, replace(base, mapping=on), device))

    single = build(Mapping())
    sharded = build(mapping)
    vocab = int(single.config.vocab_size)
    gen = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, vocab, (n + NUM_DECODE + 1,), generator=gen) for n in PROMPTS]
    schedule = chunked_schedule(PROMPTS, chunked=2, num_decode=NUM_DECODE)
    attn = _first_attention(sharded)
    gdns = [layer.linear_attn for layer in sharded.model.layers if hasattr(layer, "linear_attn")]
    return {
        "reference": _run(single, device, sequences, schedule),
        "sharded": _run(sharded, device, sequences, schedule),
        "heads": (attn.num_heads, attn.num_kv_heads),
        "embed_rows": sharded.model.embed_tokens.weight.shape[0],
        # (key heads, value heads) of each Gated DeltaNet layer on this rank
        "gdn_heads": [(g.num_k_heads, g.num_v_heads) for g in gdns],
    }


def tower_whole_and_data_parallel(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    """The VL model's tower over several images of different sizes: whole on this rank, and
    data-parallel over the tp ranks (`_run_tower`); both outputs, main and deepstack."""
    import numpy as np
    from PIL import Image

    from tensorrt_llm.inputs.registry import create_input_processor

    proc = create_input_processor(checkpoint_dir)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for h, w in ((56, 84), (28, 28), (84, 56))
    ]
    prompt = proc.default_multimodal_prompt("What is shown?", num_images=len(images))
    _, extra = proc({"prompt": prompt, "multi_modal_data": {"image": images}}, None)
    data = extra["multimodal_data"]["image"]
    config = load_pretrained_config(checkpoint_dir)
    cls = get_model_class(config.tllm_architecture)
    model_config = ModelConfig(config, checkpoint_dir=checkpoint_dir, mapping=mapping)
    model = load_model(cls, model_config, "cpu")
    pixels, grid = data["pixel_values"], data["image_grid_thw"]
    with torch.inference_mode():
        whole = model._run_tower_whole(pixels, grid)
        parallel = model._run_tower(pixels, grid)
    return {"whole": whole, "parallel": parallel, "items": int(grid.shape[0])}


def fp8_block_layers(mapping: Mapping, checkpoint_dir: str) -> dict[str, Any]:
    """Every block-FP8 layer of the checkpoint loaded at TP=1 and at this rank's TP=N:
    name -> (the TP=1 weight and scales, this rank's), as float32 / raw scales on the CPU."""
    from tensorrt_llm._torch.modules.fp8_block_model import apply_fp8_block_config_
    from tensorrt_llm._torch.quantization import QuantConfig

    config = load_pretrained_config(checkpoint_dir)
    quant = QuantConfig.from_pretrained_config(config)
    assert quant is not None
    cls = get_model_class(config.tllm_architecture)
    base = ModelConfig(pretrained_config=config, checkpoint_dir=checkpoint_dir)

    def layers(model_config: ModelConfig) -> dict[str, Any]:
        model = load_model(
            cls, model_config, "cpu", prepare=lambda m: apply_fp8_block_config_(m, quant)
        )
        return {
            name: (m.weight.float(), m.weight_scale_inv.clone(), m.fp8_block)
            for name, m in model.named_modules()
            if getattr(m, "fp8_block", None) is not None
        }

    return {"single": layers(base), "sharded": layers(replace(base, mapping=mapping))}
