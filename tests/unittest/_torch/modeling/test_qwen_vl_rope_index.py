"""get_rope_index of the Qwen-VL mixins against transformers and a plain per-token reference.

transformers 5.x advances the position after a vision block by max(h, w) // merge instead of by
the block's largest position. The two agree for images, for every Qwen3-VL/Qwen3.5 block (t=1)
and for videos whose temporal extent is not larger than their spatial one. Those cases are
compared with transformers; the rest (long videos, random layouts) with `_reference`, a plain
per-token loop written from the models' own semantics.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

from tensorrt_llm._torch.models.qwen_vl_rope_index import (
    MASKED_POSITION,
    Qwen2_5VLRopeIndexMixin,
    Qwen2VLRopeIndexMixin,
    Qwen3VLRopeIndexMixin,
)

try:
    from transformers import Qwen3_5Config
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model
except ImportError:  # older transformers without Qwen3.5
    Qwen3_5Config = Qwen3_5Model = None

IMAGE, VIDEO, VSTART, VEND, TIME = 501, 502, 503, 504, 505
MERGE = 2
TOKENS_PER_SECOND = 2


@dataclass(frozen=True)
class Family:
    name: str
    config_cls: Any
    hf_model_cls: Any
    mixin: type[Qwen2VLRopeIndexMixin]
    frames_are_blocks: bool  # Qwen3-VL/Qwen3.5: one block per frame, timestamp text between

    def config(self) -> Any:
        return self.config_cls(
            image_token_id=IMAGE,
            video_token_id=VIDEO,
            vision_start_token_id=VSTART,
            vision_end_token_id=VEND,
            text_config={"vocab_size": 600},
            vision_config={"spatial_merge_size": MERGE, "tokens_per_second": TOKENS_PER_SECOND},
        )


FAMILIES = [
    Family("qwen2_vl", Qwen2VLConfig, Qwen2VLModel, Qwen2VLRopeIndexMixin, False),
    Family("qwen2_5_vl", Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2_5VLRopeIndexMixin, False),
    Family("qwen3_vl", Qwen3VLConfig, Qwen3VLModel, Qwen3VLRopeIndexMixin, True),
]
if Qwen3_5Config is not None:
    FAMILIES.append(Family("qwen3_5", Qwen3_5Config, Qwen3_5Model, Qwen3VLRopeIndexMixin, True))
BY_NAME = {family.name: family for family in FAMILIES}
ALL = pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])


# ----------------------------------------------------------------------------- prompt building


def build_row(family: Family, segments: list[tuple[str, Any]], rng: np.random.Generator) -> list:
    """Token ids for ("text", n), ("image", (t,h,w)) and ("video", (t,h,w)) segments."""
    row: list[int] = []
    for kind, value in segments:
        if kind == "text":
            row += rng.integers(0, 500, size=value).tolist()
            continue
        t, h, w = value
        pad = IMAGE if kind == "image" else VIDEO
        per_frame = h * w // MERGE**2
        if kind == "video" and family.frames_are_blocks:
            for _ in range(t):  # "<t seconds>" text, then one block per frame
                row += [TIME, TIME + 1, VSTART] + [pad] * per_frame + [VEND]
        else:
            row += [VSTART] + [pad] * (t * per_frame) + [VEND]
    return row


def grids_of(segments: list[tuple[str, Any]], kind: str) -> torch.Tensor | None:
    grids = [value for k, value in segments if k == kind]
    return torch.tensor(grids, dtype=torch.int64) if grids else None


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row) :] = 1
    return ids, mask


# ----------------------------------------------------------------------------- references


def _hf(family: Family, config: Any, ids: torch.Tensor, images, videos, mask=None, seconds=None):
    """Calls the transformers method on a stand-in object (no model weights needed)."""
    shim = types.SimpleNamespace(config=config)
    shim.get_vision_position_ids = types.MethodType(
        family.hf_model_cls.get_vision_position_ids, shim
    )
    token_types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
    if videos is not None:
        videos = videos.clone()
    return family.hf_model_cls.get_rope_index(
        shim, ids, token_types, images, videos, attention_mask=mask, second_per_grid_ts=seconds
    )


def _reference(family: Family, ids, images, videos, mask=None, seconds=None):
    """Plain per-token loop from the models' semantics (kept independent of the vectorised code)."""
    ids = torch.as_tensor(ids).tolist()
    batch, width = len(ids), len(ids[0])
    image_list = [] if images is None else torch.as_tensor(images).tolist()
    video_list = [] if videos is None else torch.as_tensor(videos).tolist()
    second_list = [1.0] * len(video_list) if seconds is None else list(seconds)
    if family.frames_are_blocks:
        video_list = [[1, h, w] for t, h, w in video_list for _ in range(t)]
        second_list = [None] * len(video_list)
    out = torch.full((3, batch, width), MASKED_POSITION, dtype=torch.int64)
    deltas = torch.zeros(batch, 1, dtype=torch.int64)
    next_image = next_video = 0
    for b in range(batch):
        valid = [i for i in range(width) if mask is None or int(mask[b][i]) != 0]
        tokens = [ids[b][i] for i in valid]
        positions: list[tuple[int, int, int]] = []
        i = 0
        while i < len(tokens):
            start_pos = max((max(p) for p in positions), default=-1) + 1
            if i > 0 and tokens[i - 1] == VSTART and tokens[i] in (IMAGE, VIDEO):
                if tokens[i] == IMAGE:
                    (t, h, w), spt = image_list[next_image], None
                    next_image += 1
                else:
                    (t, h, w), spt = video_list[next_video], second_list[next_video]
                    next_video += 1
                for tt in range(t):
                    t_idx = tt
                    if family.name == "qwen2_5_vl" and spt is not None:
                        scaled = np.float32(tt) * np.float32(spt) * np.float32(TOKENS_PER_SECOND)
                        t_idx = int(scaled)
                    for hh in range(h // MERGE):
                        for ww in range(w // MERGE):
                            positions.append((start_pos + t_idx, start_pos + hh, start_pos + ww))
                i += t * (h // MERGE) * (w // MERGE)
            else:
                positions.append((start_pos, start_pos, start_pos))
                i += 1
        for axis in range(3):
            for j, col in enumerate(valid):
                out[axis, b, col] = positions[j][axis]
        if positions:
            deltas[b, 0] = max(max(p) for p in positions) + 1 - len(tokens)
    return out, deltas


def _ours(family: Family, config: Any, ids, images, videos, mask=None, seconds=None):
    pos, deltas = family.mixin.get_rope_index(config, ids, images, videos, mask, seconds)
    assert pos.dtype == torch.int64 and deltas.dtype == torch.int64
    assert pos.shape == (3, *torch.as_tensor(ids).shape) and deltas.shape == (pos.shape[1], 1)
    return pos, deltas


def _check(family: Family, segments_per_row, *, hf: bool, seconds=None, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    config = family.config()
    rows = [build_row(family, segments, rng) for segments in segments_per_row]
    everything = [seg for segments in segments_per_row for seg in segments]
    images, videos = grids_of(everything, "image"), grids_of(everything, "video")
    ids, mask = left_pad(rows)
    mask_arg = mask if len(rows) > 1 else None
    ours = _ours(family, config, ids, images, videos, mask_arg, seconds)
    expected = _reference(family, ids, images, videos, mask_arg, seconds)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    if hf:
        hf_seconds = None if seconds is None else torch.tensor(seconds, dtype=torch.float32)
        ref = _hf(family, config, ids, images, videos, mask_arg, hf_seconds)
        torch.testing.assert_close(ours, (ref[0], ref[1].long()), rtol=0, atol=0)


# ----------------------------------------------------------------------------- fixed layouts


def test_hand_computed_image() -> None:
    config = BY_NAME["qwen2_vl"].config()
    ids = [[7, VSTART, IMAGE, IMAGE, IMAGE, IMAGE, VEND, 8]]
    pos, deltas = Qwen2VLRopeIndexMixin.get_rope_index(config, ids, [[1, 4, 4]])
    expected = [
        [0, 1, 2, 2, 2, 2, 4, 5],
        [0, 1, 2, 2, 3, 3, 4, 5],
        [0, 1, 2, 3, 2, 3, 4, 5],
    ]
    assert pos[:, 0].tolist() == expected
    assert deltas.tolist() == [[6 - 8]]


def test_hand_computed_qwen2_5_video_time_index() -> None:
    config = BY_NAME["qwen2_5_vl"].config()
    ids = [[VSTART, VIDEO, VIDEO, VIDEO, VEND]]
    pos, deltas = Qwen2_5VLRopeIndexMixin.get_rope_index(
        config, ids, video_grid_thw=[[3, 2, 2]], second_per_grid_ts=[1.0]
    )
    # t index = int(arange(3) * 1.0 s * 2 tokens/s) = 0, 2, 4; the text after starts at 5 + 1.
    assert pos[:, 0].tolist() == [[0, 1, 3, 5, 6], [0, 1, 1, 1, 6], [0, 1, 1, 1, 6]]
    assert deltas.tolist() == [[7 - 5]]


@ALL
def test_one_image(family: Family) -> None:
    _check(family, [[("text", 5), ("image", (1, 8, 6)), ("text", 7)]], hf=True)


@ALL
def test_images_of_different_sizes(family: Family) -> None:
    segments = [
        ("text", 3),
        ("image", (1, 4, 10)),
        ("text", 2),
        ("image", (1, 12, 4)),
        ("image", (1, 6, 6)),
        ("text", 4),
    ]
    _check(family, [segments], hf=True)


@ALL
def test_short_video(family: Family) -> None:
    # Temporal extent (2) below the spatial one (4): transformers agrees with the models here.
    _check(family, [[("text", 4), ("video", (2, 8, 8)), ("text", 3)]], hf=True)


@ALL
def test_long_video(family: Family) -> None:
    # 6 frames on a 2x2 grid: transformers 5.x under-advances after the block, so only the plain
    # reference applies (except for the frame-per-block families, where t is always 1).
    _check(family, [[("text", 2), ("video", (6, 4, 4)), ("text", 3)]], hf=family.frames_are_blocks)


@ALL
def test_image_and_video(family: Family) -> None:
    segments = [("text", 3), ("image", (1, 6, 8)), ("text", 2), ("video", (2, 8, 6)), ("text", 2)]
    _check(family, [segments], hf=True)


@ALL
def test_text_only(family: Family) -> None:
    _check(family, [[("text", 9)]], hf=True)
    pos, deltas = family.mixin.get_rope_index(family.config(), [[1, 2, 3, 4]])
    assert pos.tolist() == [[[0, 1, 2, 3]]] * 3 and deltas.tolist() == [[0]]


@ALL
def test_left_padded_batch(family: Family) -> None:
    rows = [
        [("text", 2), ("image", (1, 4, 4)), ("text", 1)],
        [("text", 6), ("image", (1, 8, 4)), ("text", 5), ("image", (1, 4, 4))],
        [("text", 3)],
        [("video", (2, 4, 8)), ("text", 2)],
    ]
    _check(family, rows, hf=True)


@pytest.mark.parametrize("seconds", [[0.5], [1.0], [2.0], [0.25], [2 / 3], [1 / 3], [1.5]])
def test_qwen2_5_video_fps(seconds: list[float]) -> None:
    family = BY_NAME["qwen2_5_vl"]
    segments = [[("text", 3), ("video", (5, 4, 6)), ("text", 2)]]
    _check(family, segments, hf=False, seconds=seconds)


def test_qwen2_5_several_videos_at_several_fps() -> None:
    family = BY_NAME["qwen2_5_vl"]
    segments = [
        ("video", (2, 12, 12)),
        ("text", 2),
        ("image", (1, 4, 4)),
        ("video", (3, 16, 16)),
        ("text", 1),
        ("video", (2, 8, 8)),
    ]
    # Exact binary fractions and small extents: transformers agrees, so check it too.
    _check(family, [segments], hf=True, seconds=[0.5, 1.0, 0.25])
    _check(family, [segments], hf=False, seconds=[2.0, 1 / 3, 4.0])


def test_subclass_hook_is_used() -> None:
    class Shifted(Qwen2VLRopeIndexMixin):
        @classmethod
        def _build_temporal_block(cls, model_config, t, h, w, second_per_grid_t):
            return super()._build_temporal_block(model_config, t, h, w, second_per_grid_t) * 2

    config = BY_NAME["qwen2_vl"].config()
    ids = [[VSTART, IMAGE, IMAGE, IMAGE, IMAGE, VEND]]
    pos, _ = Shifted.get_rope_index(config, ids, [[1, 4, 4]])
    assert pos[1, 0].tolist() == [0, 1, 1, 3, 3, 4]


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "ids, images, videos, seconds, message",
    [
        ([[VSTART, IMAGE, IMAGE, VEND]], [[1, 4, 4]], None, None, "pad tokens"),
        ([[VSTART, IMAGE] + [IMAGE] * 4 + [VEND]], [[1, 4, 4]], None, None, "pad tokens"),
        ([[VSTART, IMAGE, IMAGE, IMAGE, IMAGE, VEND]], None, None, None, "more image blocks"),
        ([[1, 2]], [[1, 4, 4]], None, None, "grids were given"),
        ([[VSTART] + [VIDEO] * 4], None, [[1, 4, 4]], [1.0, 2.0], "second_per_grid_ts"),
        ([[1, IMAGE, IMAGE, IMAGE, IMAGE]], None, None, None, "outside vision blocks"),
        ([[VSTART, IMAGE, IMAGE, IMAGE, IMAGE]], [[1, 4, 3]], None, None, "multiples"),
        ([[VSTART, IMAGE]], [[1, 4]], None, None, r"shape \[N, 3\]"),
        ([1, 2, 3], None, None, None, r"shape \[B, S\]"),
        ([[1, 2], [3]], None, None, None, "rectangular"),
    ],
)
def test_bad_input_raises(ids, images, videos, seconds, message) -> None:
    config = BY_NAME["qwen2_5_vl"].config()
    with pytest.raises(ValueError, match=message):
        Qwen2_5VLRopeIndexMixin.get_rope_index(config, ids, images, videos, None, seconds)


def test_missing_config_field_raises() -> None:
    with pytest.raises(ValueError, match="image_token_id"):
        Qwen2VLRopeIndexMixin.get_rope_index(types.SimpleNamespace(), [[1, 2]])


# ----------------------------------------------------------------------------- random layouts

_SIDES = st.sampled_from([2, 4, 6, 8])
_VISION = st.tuples(st.sampled_from(["image", "video"]), st.integers(1, 4), _SIDES, _SIDES).map(
    lambda v: (v[0], (1 if v[0] == "image" else v[1], v[2], v[3]))
)
_SEGMENT = st.one_of(st.integers(1, 6).map(lambda n: ("text", n)), _VISION)
_ROW = st.lists(_SEGMENT, min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    family_name=st.sampled_from([f.name for f in FAMILIES]),
    rows=st.lists(_ROW, min_size=1, max_size=3),
    seed=st.integers(0, 2**16),
    fps_choice=st.sampled_from([0.5, 1.0, 2 / 3, 1.5, 3.0]),
)
def test_random_layouts_match_reference(family_name, rows, seed, fps_choice) -> None:
    family = BY_NAME[family_name]
    num_videos = sum(kind == "video" for row in rows for kind, _ in row)
    seconds = [fps_choice * (1 + i % 3) for i in range(num_videos)] or None
    _check(family, rows, hf=False, seconds=seconds, seed=seed)
