"""The vision tower's work under prefix caching (vision_step_encoder.py), with a fake tower:
items inside a prefix hit are never encoded, cached items never reach the tower, and every
chunk still gets exactly the embeddings a plain encode of everything would give it."""

from __future__ import annotations

import numpy as np
import torch

from tensorrt_llm._torch.models.qwen_vl_vision_inputs import chunk_embeddings
from tensorrt_llm._torch.models.vision_embedding_cache import VisionEmbeddingCache
from tensorrt_llm._torch.models.vision_step_encoder import encode_modality
from tensorrt_llm.inputs.media_hash import MULTIMODAL_HASHES
from tensorrt_llm.inputs.multimodal import (
    MultimodalParams,
    MultimodalRuntimeData,
    chunk_rows,
    spans_data,
)

MERGE = 2
HIDDEN = 3
# Two images of 2x2 merged tokens (16 patches each) at prompt positions 4 and 12.
GRID = torch.tensor([[1, 4, 4], [1, 4, 4]])
STARTS, LENGTHS = [4, 12], [4, 4]


class FakeTower:
    """Embedding of token j of an item = the mean of its 4 patch rows; counts the patches."""

    def __init__(self) -> None:
        self.patches_seen = 0

    def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, list]:
        self.patches_seen += pixels.shape[0]
        main = pixels.reshape(-1, MERGE**2, HIDDEN).mean(dim=1)
        return main, [main * 2]


def _params(seed: int, hit: int) -> MultimodalParams:
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(32, HIDDEN, generator=gen)
    data = {
        "image": {"pixel_values": pixels, "image_grid_thw": GRID},
        MULTIMODAL_HASHES: {"image": [f"{seed:02x}" * 32, f"{seed + 1:02x}" * 32]},
        **spans_data({"image": (STARTS, LENGTHS)}),
    }
    params = MultimodalParams(multimodal_data=data)
    params.runtime = MultimodalRuntimeData(request_id=seed, num_prefix_hit_tokens=hit)
    params.cached_embeddings = {}
    return params


def _chunk(params: MultimodalParams, begin: int, end: int) -> torch.Tensor:
    """The embeddings chunk_embeddings hands the prefill chunk [begin, end)."""
    cached, rows = chunk_rows(np.array(STARTS), np.array(LENGTHS), begin, end)
    runtime = params.runtime
    assert runtime is not None
    runtime.num_cached_image_tokens = cached
    runtime.num_image_tokens_in_chunk = int(rows.shape[0])
    runtime.image_rows = torch.from_numpy(rows)
    picked = chunk_embeddings(params, "image")
    assert picked is not None
    return picked[1]


def _encode(params: list[MultimodalParams], cache: VisionEmbeddingCache | None) -> FakeTower:
    tower = FakeTower()
    encode_modality(
        tower, params, "image", "pixel_values", "image_grid_thw", MERGE, torch.float32, cache
    )
    return tower


def test_items_inside_the_hit_are_skipped_and_chunks_stay_right() -> None:
    want = _params(0, hit=0)
    _encode([want], None)
    # Hit of 8 tokens: image 0 (4..8) is inside, image 1 (12..16) is not.
    got = _params(0, hit=8)
    tower = _encode([got], None)
    assert tower.patches_seen == 16  # image 1 only
    assert torch.equal(_chunk(got, 8, 16), _chunk(want, 8, 16))
    # A hit ending inside image 1 encodes it whole; the chunk takes its tail.
    cut = _params(0, hit=14)
    tower = _encode([cut], None)
    assert tower.patches_seen == 16
    assert torch.equal(_chunk(cut, 14, 20), _chunk(want, 14, 20))


def test_the_embedding_cache_serves_repeated_items() -> None:
    cache = VisionEmbeddingCache(1 << 20)
    first = _params(0, hit=0)
    assert _encode([first], cache).patches_seen == 32
    assert len(cache) == 2
    # The same content (same hashes), no KV hit: both items come from the cache.
    again = _params(0, hit=0)
    other = _params(5, hit=0)
    tower = _encode([again, other], cache)
    assert tower.patches_seen == 32  # only `other`'s two images
    assert torch.equal(_chunk(again, 0, 20), _chunk(first, 0, 20))
    assert cache.hits == 2
    # Deepstack levels come back from the cache as well.
    stack = again.cached_embeddings["image"][1]  # type: ignore[index]
    assert torch.equal(stack[0], first.cached_embeddings["image"][1][0])  # type: ignore[index]
