"""The vision tower data-parallel over 2 gloo ranks (`mm_encoder_tp_mode="data"`): each rank
encodes a share of a step's images and the gathered embeddings (main and deepstack) equal the
tower run whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tp_bodies import tower_whole_and_data_parallel
from tp_harness import spawn_ranks

from tensorrt_llm._torch.models.vision_data_parallel import split_items
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def test_split_items_balances_tokens_and_fills_every_part() -> None:
    assert split_items([4, 4, 4, 4], 2) == [(0, 2), (2, 4)]
    assert split_items([10, 1, 1], 2) == [(0, 1), (1, 3)]
    assert split_items([1, 1, 10], 2) == [(0, 2), (2, 3)]
    assert split_items([1, 1, 1], 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="2 items cannot fill 3 parts"):
        split_items([1, 1], 3)


def test_tp2_tower_data_parallel_equals_whole(tmp_path: Path) -> None:
    ckpts = [write_tiny_checkpoint(f, tmp_path / f) for f in ("qwen2_5_vl", "qwen3_vl")]
    for ckpt in ckpts:
        for rank, result in enumerate(spawn_ranks(tower_whole_and_data_parallel, 2, str(ckpt))):
            assert result["items"] == 3
            (main_w, levels_w), (main_p, levels_p) = result["whole"], result["parallel"]
            msg = f"{ckpt.name} rank {rank}"
            torch.testing.assert_close(main_p, main_w, atol=1e-5, rtol=1e-5, msg=msg)
            # Qwen3-VL's deepstack levels are gathered with the main embeddings.
            assert (len(levels_w) > 0) == (ckpt.name == "qwen3_vl"), msg
            for lp, lw in zip(levels_p, levels_w, strict=True):
                torch.testing.assert_close(lp, lw, atol=1e-5, rtol=1e-5, msg=msg)
