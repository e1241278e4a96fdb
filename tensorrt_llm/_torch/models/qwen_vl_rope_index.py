"""mRoPE position ids of a Qwen-VL prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5).

The input processors inherit one of the mixins below and call `get_rope_index` on the host, once
per request. The work is vectorised with numpy: one Python step per vision block, never one per
token, so a prompt with thousands of vision tokens costs well under a millisecond.

Semantics (the models' own):
- text tokens get one position, equal on all three axes, one more than the previous maximum;
- a vision block found as `vision_start` followed by the image or video pad token gets the
  (t, h, w) index grid of its `grid_thw` (h, w divided by the spatial merge size) plus an offset
  of previous maximum + 1;
- text after a block continues from the maximum of every position in that block, plus one;
- delta = max(position) + 1 - number of valid tokens (usually negative).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# NOTE: positions of masked tokens (attention_mask == 0). transformers 5.x fills them with 0
# (4.x used 1); we match the installed reference so batched outputs compare whole.
MASKED_POSITION = 0

ArrayLike = torch.Tensor | np.ndarray | Sequence[Any]


@dataclass(frozen=True)
class _VisionTokens:
    """The special token ids and merge size that locate vision blocks in a prompt."""

    image: int
    video: int
    vision_start: int
    merge: int


def _read_vision_tokens(model_config: Any) -> _VisionTokens:
    values: dict[str, int] = {}
    for name in ("image_token_id", "video_token_id", "vision_start_token_id"):
        value = getattr(model_config, name, None)
        if value is None:
            raise ValueError(f"model_config has no {name}; get_rope_index needs it")
        values[name] = int(value)
    vision_config = getattr(model_config, "vision_config", None)
    merge = getattr(vision_config, "spatial_merge_size", None)
    if merge is None or int(merge) < 1:
        raise ValueError("model_config.vision_config.spatial_merge_size must be a positive int")
    return _VisionTokens(
        image=values["image_token_id"],
        video=values["video_token_id"],
        vision_start=values["vision_start_token_id"],
        merge=int(merge),
    )


def _to_numpy(value: ArrayLike, dtype: type, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a rectangular array of numbers: {exc}") from exc


def _as_grids(grid_thw: ArrayLike | None, name: str, merge: int) -> np.ndarray:
    """[N, 3] int64 grids; h and w must divide by the merge size."""
    if grid_thw is None:
        return np.zeros((0, 3), dtype=np.int64)
    grids = _to_numpy(grid_thw, np.int64, name)
    if grids.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    if grids.ndim != 2 or grids.shape[1] != 3:
        raise ValueError(f"{name} must have shape [N, 3], got {list(grids.shape)}")
    if (grids < 1).any():
        raise ValueError(f"{name} entries must be positive, got {grids.tolist()}")
    if (grids[:, 1:] % merge).any():
        raise ValueError(f"{name} h and w must be multiples of spatial_merge_size={merge}")
    return grids


class _GridCursor:
    """Hands out image and video grids in order of appearance, across the whole batch."""

    def __init__(self, images: np.ndarray, videos: np.ndarray, seconds: np.ndarray) -> None:
        self._images = images.tolist()
        self._videos = videos.tolist()
        self._seconds = seconds.tolist()
        self._next_image = 0
        self._next_video = 0

    def take(self, video: bool) -> tuple[list[int], float | None]:
        if video:
            if self._next_video >= len(self._videos):
                raise ValueError(
                    f"prompt has more video blocks than video_grid_thw rows ({len(self._videos)})"
                )
            index, self._next_video = self._next_video, self._next_video + 1
            return self._videos[index], self._seconds[index]
        if self._next_image >= len(self._images):
            raise ValueError(
                f"prompt has more image blocks than image_grid_thw rows ({len(self._images)})"
            )
        index, self._next_image = self._next_image, self._next_image + 1
        return self._images[index], None

    def check_used(self) -> None:
        if self._next_image != len(self._images) or self._next_video != len(self._videos):
            raise ValueError(
                f"prompt has {self._next_image} image and {self._next_video} video blocks, but "
                f"{len(self._images)} image and {len(self._videos)} video grids were given"
            )


def _plain_grid(t_index: np.ndarray, h: int, w: int) -> np.ndarray:
    """[3, len(t_index)*h*w] (t, h, w) indices in row-major (t, h, w) order."""
    t = t_index.shape[0]
    temporal = np.repeat(t_index.astype(np.int64), h * w)
    height = np.tile(np.repeat(np.arange(h, dtype=np.int64), w), t)
    width = np.tile(np.arange(w, dtype=np.int64), t * h)
    return np.stack([temporal, height, width])


class Qwen2VLRopeIndexMixin:
    """`get_rope_index` for Qwen2-VL; subclasses change the temporal index through the hook."""

    @classmethod
    def _build_temporal_block(
        cls, model_config: Any, t: int, h: int, w: int, second_per_grid_t: float | None
    ) -> np.ndarray | torch.Tensor:
        """[3, t*h*w] index grid of one vision block, before the offset (h, w already merged).

        Qwen2-VL uses a plain index grid and ignores the video's frame timing.
        """
        return _plain_grid(np.arange(t, dtype=np.int64), h, w)

    @classmethod
    def get_rope_index(
        cls,
        model_config: Any,
        input_ids: ArrayLike,
        image_grid_thw: ArrayLike | None = None,
        video_grid_thw: ArrayLike | None = None,
        attention_mask: ArrayLike | None = None,
        second_per_grid_ts: ArrayLike | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (position_ids int64 [3, B, S], deltas int64 [B, 1]), both on the CPU.

        Grids are consumed in order of appearance over the batch. `second_per_grid_ts` has one
        entry per video (1.0 each when missing). Masked tokens take `MASKED_POSITION` and do not
        count toward positions or the delta.
        """
        tokens = _read_vision_tokens(model_config)
        ids = _to_numpy(input_ids, np.int64, "input_ids")
        if ids.ndim != 2:
            raise ValueError(f"input_ids must have shape [B, S], got {list(ids.shape)}")
        mask = None
        if attention_mask is not None:
            mask = _to_numpy(attention_mask, np.int64, "attention_mask") != 0
            if mask.shape != ids.shape:
                raise ValueError(
                    f"attention_mask shape {list(mask.shape)} != input_ids shape {list(ids.shape)}"
                )
        videos, seconds = cls._video_blocks(video_grid_thw, second_per_grid_ts, tokens.merge)
        cursor = _GridCursor(
            _as_grids(image_grid_thw, "image_grid_thw", tokens.merge), videos, seconds
        )
        batch, seq_len = ids.shape
        positions = np.full((3, batch, seq_len), MASKED_POSITION, dtype=np.int64)
        deltas = np.zeros((batch, 1), dtype=np.int64)
        for row in range(batch):
            row_ids = ids[row] if mask is None else ids[row][mask[row]]
            row_pos = cls._row_positions(model_config, row_ids, tokens, cursor)
            if mask is None:
                positions[:, row] = row_pos
            else:
                positions[:, row, mask[row]] = row_pos
            if row_ids.size:
                deltas[row, 0] = row_pos.max() + 1 - row_ids.size
        cursor.check_used()
        return torch.from_numpy(positions), torch.from_numpy(deltas)

    @classmethod
    def _video_blocks(
        cls, video_grid_thw: ArrayLike | None, second_per_grid_ts: ArrayLike | None, merge: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """([N, 3] grids, [N] seconds per grid) of the video blocks, in prompt order."""
        videos = _as_grids(video_grid_thw, "video_grid_thw", merge)
        return videos, cls._video_seconds(second_per_grid_ts, videos.shape[0])

    @staticmethod
    def _video_seconds(second_per_grid_ts: ArrayLike | None, num_videos: int) -> np.ndarray:
        if second_per_grid_ts is None:
            return np.ones(num_videos, dtype=np.float64)
        seconds = _to_numpy(second_per_grid_ts, np.float64, "second_per_grid_ts").reshape(-1)
        if seconds.shape[0] != num_videos:
            raise ValueError(
                f"second_per_grid_ts has {seconds.shape[0]} entries for {num_videos} videos"
            )
        return seconds

    @classmethod
    def _row_positions(
        cls, model_config: Any, ids: np.ndarray, tokens: _VisionTokens, cursor: _GridCursor
    ) -> np.ndarray:
        """[3, n] positions of one row's valid tokens."""
        n = ids.shape[0]
        is_pad = (ids == tokens.image) | (ids == tokens.video)
        # A block's first pad token sits right after vision_start; the pad id picks the grid kind.
        starts = np.flatnonzero((ids[:-1] == tokens.vision_start) & is_pad[1:]) + 1
        is_video = (ids[starts] == tokens.video).tolist()
        # Text position = token index + shift; the shift only changes at the end of a block, so
        # record each change once and integrate with a cumsum.
        shift_steps = np.zeros(n + 1, dtype=np.int64)
        blocks: list[tuple[int, int, np.ndarray]] = []
        shift = 0
        num_pads = 0
        for start, video in zip(starts.tolist(), is_video, strict=True):
            (t, h, w), seconds = cursor.take(video)
            h, w = h // tokens.merge, w // tokens.merge
            end = start + t * h * w
            pad_id = tokens.video if video else tokens.image
            if end > n or (ids[start:end] != pad_id).any() or (end < n and ids[end] == pad_id):
                kind = "video" if video else "image"
                raise ValueError(
                    f"{kind} block at token {start} does not hold the {t * h * w} pad tokens "
                    f"its grid ({t}, {h * tokens.merge}, {w * tokens.merge}) needs"
                )
            block = cls._checked_block(model_config, t, h, w, seconds)
            offset = start + shift
            blocks.append((start, end, block + offset))
            new_shift = offset + int(block.max()) + 1 - end
            shift_steps[end] += new_shift - shift
            shift = new_shift
            num_pads += end - start
        if int(is_pad.sum()) != num_pads:
            raise ValueError(
                "image/video pad tokens found outside vision blocks (each block must start "
                "right after vision_start_token_id)"
            )
        text = np.arange(n, dtype=np.int64) + np.cumsum(shift_steps[:n])
        positions = np.broadcast_to(text, (3, n)).copy()
        for start, end, block in blocks:
            positions[:, start:end] = block
        return positions

    @classmethod
    def _checked_block(
        cls, model_config: Any, t: int, h: int, w: int, seconds: float | None
    ) -> np.ndarray:
        block = cls._build_temporal_block(model_config, t, h, w, seconds)
        block = _to_numpy(block, np.int64, "_build_temporal_block output")
        if block.shape != (3, t * h * w):
            raise ValueError(
                f"_build_temporal_block returned shape {list(block.shape)}, "
                f"expected [3, {t * h * w}]"
            )
        return block


def _tokens_per_second(model_config: Any) -> float:
    vision_config = getattr(model_config, "vision_config", None)
    value = getattr(vision_config, "tokens_per_second", None)
    if value is None:
        value = getattr(model_config, "tokens_per_second", None)
    if value is None:
        raise ValueError("Qwen2.5-VL needs vision_config.tokens_per_second for video positions")
    return float(value)


class Qwen2_5VLRopeIndexMixin(Qwen2VLRopeIndexMixin):
    """Qwen2.5-VL: a video's temporal index follows wall-clock time."""

    @classmethod
    def _build_temporal_block(
        cls, model_config: Any, t: int, h: int, w: int, second_per_grid_t: float | None
    ) -> np.ndarray | torch.Tensor:
        if second_per_grid_t is None:  # a still image: nothing to space out in time
            return _plain_grid(np.arange(t, dtype=np.int64), h, w)
        # NOTE: float32, multiplied left to right and truncated, as the model's own code does;
        # another order or precision can land on the other side of an integer.
        scaled = (
            np.arange(t, dtype=np.float32)
            * np.float32(second_per_grid_t)
            * np.float32(_tokens_per_second(model_config))
        )
        return _plain_grid(scaled.astype(np.int64), h, w)


class Qwen3VLRopeIndexMixin(Qwen2VLRopeIndexMixin):
    """Qwen3-VL and Qwen3.5: every video frame is its own vision block.

    The prompt separates frames with timestamp text, which takes ordinary text positions, so a
    video's grid is split into one t=1 grid per frame. Frame timing lives in that text, not in
    the temporal index, so `second_per_grid_ts` is ignored.
    """

    @classmethod
    def _video_blocks(
        cls, video_grid_thw: ArrayLike | None, second_per_grid_ts: ArrayLike | None, merge: int
    ) -> tuple[np.ndarray, np.ndarray]:
        videos = _as_grids(video_grid_thw, "video_grid_thw", merge)
        frames = np.repeat(videos, videos[:, 0], axis=0)
        frames[:, 0] = 1
        return frames, np.ones(frames.shape[0], dtype=np.float64)
