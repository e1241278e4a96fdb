"""Media content hashes: what changes an item's hash, per-item splitting, run assignment."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm.inputs.media_hash import (
    MULTIMODAL_HASHES,
    hash_multimodal_data,
    hash_multimodal_item,
    item_runs,
    split_pixel_rows,
)
from tensorrt_llm.inputs.multimodal import spans_data

GRID = torch.tensor([1, 4, 4])


def _pixels(seed: int = 0, rows: int = 16) -> torch.Tensor:
    return torch.randn(rows, 12, generator=torch.Generator().manual_seed(seed))


def test_same_content_same_hash_and_deterministic() -> None:
    a = hash_multimodal_item("image", _pixels(), GRID)
    assert a == hash_multimodal_item("image", _pixels().clone(), GRID.tolist())
    assert len(a) == 32
    # A non-contiguous tensor with the same values hashes like its contiguous copy.
    wide = torch.cat([_pixels(), _pixels()], dim=1)[:, :12]
    assert hash_multimodal_item("image", wide, GRID) == a


def test_every_input_changes_the_hash() -> None:
    base = hash_multimodal_item("image", _pixels(), GRID)
    changed = _pixels()
    changed[3, 5] += 1e-3
    variants = [
        hash_multimodal_item("image", changed, GRID),
        hash_multimodal_item("image", _pixels().to(torch.bfloat16), GRID),  # dtype
        hash_multimodal_item("image", _pixels().reshape(32, 6), GRID),  # shape, same bytes
        hash_multimodal_item("image", _pixels(), torch.tensor([1, 2, 8])),  # grid
        hash_multimodal_item("video", _pixels(), GRID),  # modality
        hash_multimodal_item("image", _pixels(), GRID, {"max_pixels": 1 << 20}),
        hash_multimodal_item("image", _pixels(), GRID, second_per_grid=0.5),
    ]
    assert len({base, *variants}) == len(variants) + 1


def test_kwargs_order_does_not_matter() -> None:
    a = hash_multimodal_item("image", _pixels(), GRID, {"min_pixels": 1, "max_pixels": 2})
    b = hash_multimodal_item("image", _pixels(), GRID, {"max_pixels": 2, "min_pixels": 1})
    assert a == b
    assert hash_multimodal_item("image", _pixels(), GRID, {}) == hash_multimodal_item(
        "image", _pixels(), GRID, None
    )


def test_split_rows_and_hash_each_item() -> None:
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    first, second = _pixels(1), _pixels(2, rows=8)
    packed = torch.cat([first, second])
    parts = split_pixel_rows(packed, grids)
    assert [p.shape[0] for p in parts] == [16, 8]
    with pytest.raises(ValueError, match="patches"):
        split_pixel_rows(packed[:-1], grids)
    data = {
        "image": {"pixel_values": packed, "image_grid_thw": grids},
        "video": {
            "pixel_values_videos": _pixels(3),
            "video_grid_thw": torch.tensor([[1, 4, 4]]),
            "second_per_grid_ts": torch.tensor([1.0]),
        },
        "mrope_config": {},
    }
    hashes = hash_multimodal_data(data)
    assert hashes["image"] == [
        hash_multimodal_item("image", first, grids[0]).hex(),
        hash_multimodal_item("image", second, grids[1]).hex(),
    ]
    assert hashes["video"] == [
        hash_multimodal_item("video", _pixels(3), GRID, second_per_grid=1.0).hex()
    ]
    # The same image in another request (another position, other neighbours) hashes the same.
    alone = {"image": {"pixel_values": second, "image_grid_thw": grids[1:]}}
    assert hash_multimodal_data(alone)["image"] == hashes["image"][1:]
    assert hash_multimodal_data({"mrope_config": {}}) == {}
    assert MULTIMODAL_HASHES == "multimodal_hashes"


def test_item_runs_groups_runs_by_token_count() -> None:
    # A video of 3 temporal patches, 2x4 patches each (merge 2 -> 2 tokens a patch): 6 tokens
    # in three runs (Qwen3-VL), then a one-run video of 4 tokens (Qwen2-VL layout).
    data = {
        "video": {"video_grid_thw": torch.tensor([[3, 2, 4], [1, 4, 4]])},
        **spans_data({"video": ([5, 10, 15, 30], [2, 2, 2, 4])}),
    }
    assert item_runs(data, "video", merge_size=2) == [[(5, 2), (10, 2), (15, 2)], [(30, 4)]]
    assert item_runs(data, "image", merge_size=2) == []
    bad = {**data, **spans_data({"video": ([5, 10], [2, 3])})}
    with pytest.raises(ValueError, match="add up"):
        item_runs(bad, "video", merge_size=2)
    extra = {**data, **spans_data({"video": ([5, 10, 15, 30, 40], [2, 2, 2, 4, 1])})}
    with pytest.raises(ValueError, match="belong to no item"):
        item_runs(extra, "video", merge_size=2)
