"""The mRoPE core: selective device moves and the seq-slot delta cache."""

from __future__ import annotations

import pytest
import torch

from tensorrt_llm._torch.models.modeling_multimodal_utils import (
    MROPE_DEVICE_PATHS,
    compose_device_paths,
)
from tensorrt_llm._torch.models.modeling_qwen2vl import (
    _prepare_qwen_vl_mrope_config,
    apply_generation_deltas,
)
from tensorrt_llm.inputs.multimodal import MultimodalParams

QWEN2VL_PATHS = compose_device_paths(
    ["image.pixel_values", "image.image_grid_thw", "video.pixel_values_videos"]
)


def _params(delta: int, dtype: torch.dtype = torch.int32, device: str = "cpu") -> MultimodalParams:
    length = 5
    return MultimodalParams(
        multimodal_data={
            "image": {
                "pixel_values": torch.randn(4, 8),
                "image_grid_thw": torch.tensor([[1, 2, 2]]),
            },
            "mrope_config": {
                "mrope_position_ids": torch.arange(length).expand(3, 1, length).clone(),
                "mrope_position_deltas": torch.tensor([[delta]], dtype=dtype, device=device),
            },
            "extra": {"unlisted": torch.zeros(2)},
        }
    )


class _RecordingRotary:
    """Stands in for MRotaryEmbedding and records whether cos/sin were requested."""

    def __init__(self) -> None:
        self.calls: list[torch.Tensor] = []

    def get_cos_sin(self, position_ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(position_ids)
        return torch.zeros(position_ids.shape[-1], 8)


def _cache(num_slots: int, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.zeros(num_slots + 1, dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------- device paths


def test_compose_always_adds_both_mrope_keys() -> None:
    paths = compose_device_paths(["image.pixel_values"], ["image.pixel_values"])
    assert paths.count("image.pixel_values") == 1
    for key in MROPE_DEVICE_PATHS:
        assert key in paths
    assert set(MROPE_DEVICE_PATHS) == {
        "mrope_config.mrope_position_ids",
        "mrope_config.mrope_position_deltas",
    }


def test_to_device_moves_listed_paths_only() -> None:
    # NOTE: the meta device stands in for a GPU on CPU-only CI: a path that is not moved
    # stays on "cpu" and the assertions below fail.
    p = _params(3)
    p.to_device("multimodal_data", "meta", target_keywords=QWEN2VL_PATHS)
    data = p.multimodal_data
    assert data["mrope_config"]["mrope_position_ids"].device.type == "meta"
    assert data["mrope_config"]["mrope_position_deltas"].device.type == "meta"
    assert data["image"]["pixel_values"].device.type == "meta"
    assert data["extra"]["unlisted"].device.type == "cpu"


def test_to_device_skips_missing_paths() -> None:
    p = MultimodalParams(
        {"mrope_config": {"mrope_position_deltas": torch.zeros(1, 1, dtype=torch.int32)}}
    )
    p.to_device("multimodal_data", "meta", target_keywords=QWEN2VL_PATHS + ["no.such.path"])
    assert p.multimodal_data["mrope_config"]["mrope_position_deltas"].device.type == "meta"
    assert set(p.multimodal_data) == {"mrope_config"}


def test_to_device_none_moves_everything() -> None:
    p = _params(1)
    p.to_device("multimodal_data", "meta", target_keywords=None)
    assert p.multimodal_data["extra"]["unlisted"].device.type == "meta"
    assert p.multimodal_data["image"]["image_grid_thw"].device.type == "meta"


def test_strip_for_generation_keeps_only_delta() -> None:
    p = _params(7)
    assert p.has_content()
    p.strip_for_generation()
    assert p.multimodal_data == {
        "mrope_config": {"mrope_position_deltas": torch.tensor([[7]], dtype=torch.int32)}
    }
    empty = MultimodalParams({"image": {"pixel_values": torch.zeros(1)}})
    empty.strip_for_generation()
    assert not empty.has_content()


# ----------------------------------------------------------------------------- delta cache


def test_write_then_read_slots() -> None:
    cache = _cache(8)
    _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([2, 5]),
        torch.tensor([], dtype=torch.long),
        [_params(11), _params(22)],
        _RecordingRotary(),
        torch.zeros(3, 1, 10, dtype=torch.int32),
    )
    out = _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([], dtype=torch.long),
        torch.tensor([2, 5]),
        [],
        None,
        torch.zeros(3, 1, 2, dtype=torch.int32),
    )
    assert out["mrope_position_deltas"].tolist() == [[11], [22]]
    assert out["mrope_position_deltas"].dtype == torch.int32


def test_cpu_deltas_into_cache_on_other_device() -> None:
    cache = _cache(4, device="meta")
    out = _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([1]),
        torch.tensor([1, 4]),
        [_params(5)],
        None,
        torch.zeros(3, 1, 6, dtype=torch.int32, device="meta"),
    )
    assert out["mrope_position_deltas"].device.type == "meta"
    assert out["mrope_position_deltas"].shape == (2, 1)


def test_mixed_devices_and_int64_deltas() -> None:
    cache = _cache(4)
    params = [_params(-3, dtype=torch.int64), _params(9, dtype=torch.int16)]
    _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([0, 3]),
        torch.tensor([], dtype=torch.long),
        params,
        None,
        torch.zeros(3, 1, 4, dtype=torch.int32),
    )
    assert cache.tolist() == [-3, 0, 0, 9, 0]


def test_count_mismatch_raises_naming_both_counts() -> None:
    with pytest.raises(RuntimeError, match=r"1 deltas for 2 context write slots"):
        _prepare_qwen_vl_mrope_config(
            _cache(4),
            torch.tensor([0, 1]),
            torch.tensor([], dtype=torch.long),
            [_params(1)],
            None,
            torch.zeros(3, 1, 4, dtype=torch.int32),
        )


def test_pure_generation_builds_no_cos_sin() -> None:
    rotary = _RecordingRotary()
    out = _prepare_qwen_vl_mrope_config(
        _cache(4),
        torch.tensor([], dtype=torch.long),
        torch.tensor([0, 1]),
        [],
        rotary,
        torch.zeros(3, 1, 2, dtype=torch.int32),
    )
    assert out["mrope_rotary_cos_sin"] is None
    assert rotary.calls == []
    ctx = _prepare_qwen_vl_mrope_config(
        _cache(4),
        torch.tensor([0]),
        torch.tensor([], dtype=torch.long),
        [_params(2)],
        rotary,
        torch.zeros(3, 1, 5, dtype=torch.int32),
    )
    assert ctx["mrope_rotary_cos_sin"].shape == (5, 8)
    assert len(rotary.calls) == 1


def test_dummy_slot_reads_zero() -> None:
    cache = _cache(3)
    dummy = cache.numel() - 1
    _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([0, 1, 2]),
        torch.tensor([], dtype=torch.long),
        [_params(4), _params(5), _params(6)],
        None,
        torch.zeros(3, 1, 3, dtype=torch.int32),
    )
    out = _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([], dtype=torch.long),
        torch.tensor([dummy, 1]),
        [],
        None,
        torch.zeros(3, 1, 2, dtype=torch.int32),
    )
    assert out["mrope_position_deltas"].tolist() == [[0], [5]]


def test_generation_positions_add_delta_on_all_axes() -> None:
    pos = torch.tensor([0, 1, 2, 10, 20], dtype=torch.int32).expand(3, 1, 5).clone()
    out = apply_generation_deltas(pos, torch.tensor([[-4], [3]], dtype=torch.int32), 3)
    assert out[:, 0, :].tolist() == [[0, 1, 2, 6, 23]] * 3
    assert pos[0, 0, 3] == 10  # input untouched


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_cuda_cache_with_cpu_and_cuda_deltas() -> None:
    cache = _cache(8, device="cuda")
    params = [_params(11), _params(22, dtype=torch.int64, device="cuda")]
    _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([2, 5]),
        torch.tensor([], dtype=torch.long),
        params,
        None,
        torch.zeros(3, 1, 10, dtype=torch.int32, device="cuda"),
    )
    out = _prepare_qwen_vl_mrope_config(
        cache,
        torch.tensor([], dtype=torch.long, device="cuda"),
        torch.tensor([2, 5, 8], device="cuda"),
        [],
        None,
        torch.zeros(3, 1, 3, dtype=torch.int32, device="cuda"),
    )
    assert out["mrope_position_deltas"].device.type == "cuda"
    assert out["mrope_position_deltas"].cpu().tolist() == [[11], [22], [0]]


@pytest.mark.gpu
def test_cuda_to_device_moves_mrope_keys() -> None:
    p = _params(3)
    p.to_device("multimodal_data", "cuda", pin_memory=True, target_keywords=QWEN2VL_PATHS)
    assert p.multimodal_data["mrope_config"]["mrope_position_deltas"].is_cuda
    assert p.multimodal_data["mrope_config"]["mrope_position_ids"].is_cuda
    assert not p.multimodal_data["extra"]["unlisted"].is_cuda
