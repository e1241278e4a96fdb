"""The vision embedding cache at tensor_parallel_size=2 (2 gloo ranks, Qwen3-VL with deepstack
on the CPU). The tower is data-parallel, so every rank must skip the same cached items and
split only the misses: each rank builds a cache of rank 0's capacity when rank 0 builds its
own (after the capacity probe) and sees the same lookups and puts, so hits, misses and LRU
evictions are the same on every rank and equal TP=1's.

Requests run one at a time: [A, B], [B, A], [C, A], [B] with room for two images' embeddings.
The second request's images differ from the first's at the first image, so no KV prefix
covers them: both come from the cache and the tower does not run (on any rank). Then C is
encoded and evicts B (least recently used), and B again evicts A. Greedy tokens equal TP=1's.
"""

from __future__ import annotations

from pathlib import Path

from tp_feature_bodies import items_check, vision_cache_tp1_and_tp
from tp_harness import spawn_ranks

from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def _entry_bytes(ckpt: Path) -> int:
    """Bytes one 56 x 84 image's cache entry takes: its merged tokens x hidden, main output
    and each deepstack level, float32 (the CPU's dtype)."""
    import json

    import numpy as np
    from PIL import Image

    proc = create_input_processor(str(ckpt))
    image = Image.fromarray(np.zeros((56, 84, 3), dtype=np.uint8))
    prompt = proc.default_multimodal_prompt("x", num_images=1)
    _, extra = proc({"prompt": prompt, "multi_modal_data": {"image": [image]}}, None)
    cfg = json.loads((ckpt / "config.json").read_text())
    vision = cfg["vision_config"]
    grid = extra["multimodal_data"]["image"]["image_grid_thw"]
    tokens = int(grid.prod()) // vision["spatial_merge_size"] ** 2
    levels = 1 + len(vision.get("deepstack_visual_indexes", ()))
    return tokens * vision["out_hidden_size"] * levels * 4


def test_tp2_vision_cache_skips_the_tower_on_every_rank(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3_vl", tmp_path / "qwen3_vl")
    capacity = 2 * _entry_bytes(ckpt) + _entry_bytes(ckpt) // 2  # two entries fit
    rank0, worker = spawn_ranks(vision_cache_tp1_and_tp, 2, str(ckpt), capacity)
    single, sharded = rank0
    # TP=1: request 2 finds both images, 3 encodes C only, 4 encodes B only.
    assert single["tower"] == [2, 1, 1]
    want = {"capacity": capacity, "hits": 3, "misses": 4, "evictions": 2}
    assert {k: single["cache"][k] for k in want} == want
    assert len(single["cache"]["keys"]) == 2
    # TP=2: the same cache on both ranks, entry for entry, in the same LRU order.
    assert sharded["cache"] == single["cache"]
    assert worker["cache"] == single["cache"]
    assert worker["caches"] == 1  # built once, after the probe
    # Request 1 splits its two misses (one a rank); 3 and 4 have one item: whole on each.
    assert sharded["tower"] == worker["tower"] == [1, 1, 1]
    assert sharded["tokens"] == single["tokens"]


def test_ranks_that_planned_different_items_fail_together() -> None:
    # Same counts in another order, then one item more: each rank raises, none waits.
    assert spawn_ranks(items_check, 2, [[6, 4], [6, 4]]) == ["", ""]
    for plans in ([[6, 4], [4, 6]], [[6, 4], [6, 4, 1]]):
        for message in spawn_ranks(items_check, 2, plans):
            assert "planned different image items" in message
            assert "vision embedding caches diverged" in message


def test_llm_tp2_image_sent_twice_equals_tp1(tmp_path: Path) -> None:
    # Through `LLM` (the input preparer's content hashes, the real rank processes): the
    # second request's images are the first's in the other order, served by the caches.
    import numpy as np
    from PIL import Image

    from tensorrt_llm import LLM, SamplingParams

    ckpt = write_tiny_checkpoint("qwen3_vl", tmp_path / "qwen3_vl")
    proc = create_input_processor(str(ckpt))
    rng = np.random.default_rng(0)
    a, b = (Image.fromarray(rng.integers(0, 256, (56, 84, 3), dtype=np.uint8)) for _ in "ab")
    prompt = proc.default_multimodal_prompt("What is shown?", num_images=2)
    inputs = [{"prompt": prompt, "multi_modal_data": {"image": pair}} for pair in ([a, b], [b, a])]
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    kwargs = dict(device="cpu", max_batch_size=2, max_num_tokens=16)
    outputs = []
    for tp in (1, 2):
        with LLM(str(ckpt), tensor_parallel_size=tp, **kwargs) as llm:
            outputs.append([llm.generate(x, greedy).outputs[0].token_ids for x in inputs])
    assert outputs[1] == outputs[0]
