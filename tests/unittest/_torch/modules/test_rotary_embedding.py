"""Rotary tables vs direct computation and vs the HF rotary classes (contiguous and
interleaved mRoPE, partial rotary)."""

from __future__ import annotations

import pytest
import torch
import transformers

from tensorrt_llm._torch.modules.rotary_embedding import (
    MRotaryEmbedding,
    RotaryEmbedding,
    apply_rotary_emb,
    mrope_channel_axes,
)


def _direct(positions: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    freqs = positions.double()[:, None] * inv_freq[None]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()


@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rope_table_matches_direct_computation(rotary_dim: int) -> None:
    rope = RotaryEmbedding(head_dim=32, rotary_dim=rotary_dim, base=10000.0, max_positions=512)
    positions = torch.tensor([0, 1, 7, 300, 511, 3])
    got = rope.get_cos_sin(positions)
    assert got.shape == (6, rotary_dim) and got.dtype == torch.float32
    torch.testing.assert_close(got, _direct(positions, rotary_dim, 10000.0), atol=2e-5, rtol=0)
    torch.testing.assert_close(rope.get_cos_sin(positions[None]), got)
    # the engine's persistent position buffer is int32
    torch.testing.assert_close(rope.get_cos_sin(positions.int()), got)


def test_rope_forward_does_not_recompute_trig(monkeypatch: pytest.MonkeyPatch) -> None:
    rope = MRotaryEmbedding(16, 16, 10000.0, 64, mrope_section=(3, 3, 2), interleaved=True)

    def boom(*_args: object, **_kw: object) -> None:
        raise AssertionError("cos/sin recomputed in forward")

    monkeypatch.setattr(torch.Tensor, "cos", boom)
    monkeypatch.setattr(torch.Tensor, "sin", boom)
    rope.get_cos_sin(torch.tensor([[1, 2], [3, 4], [5, 6]]))
    rope.get_cos_sin(torch.tensor([1, 2]))


@pytest.mark.parametrize(
    "section, interleaved, message",
    [((2, 3, 2), False, "sum"), ((2, 3), False, "3 entries"), ((0, 5, 3), True, "does not fit")],
)
def test_mrope_section_validation(section, interleaved, message) -> None:
    with pytest.raises(ValueError, match=message):
        MRotaryEmbedding(16, 16, 10000.0, 32, mrope_section=section, interleaved=interleaved)


def test_rotary_dim_validation() -> None:
    with pytest.raises(ValueError, match="exceeds head_dim"):
        RotaryEmbedding(16, 32)
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(16, 7)


def test_channel_axes_layouts() -> None:
    assert mrope_channel_axes((2, 1, 1), False).tolist() == [0, 0, 1, 2]
    # T,H,W interleaved for 2 H and 2 W frequencies, the tail goes to T
    assert mrope_channel_axes((3, 2, 2), True).tolist() == [0, 1, 2, 0, 1, 2, 0]


def _positions_3d(length: int) -> torch.Tensor:
    ar = torch.arange(length)
    return torch.stack([ar, 2 * ar // 3, (5 * ar) % 17])


def _hf_cos_sin(rotary_cls: type, config: object, positions: torch.Tensor) -> torch.Tensor:
    hf = rotary_cls(config)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[:, None])
    half = cos.shape[-1] // 2
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)


def test_contiguous_mrope_matches_hf_qwen2_vl() -> None:
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding

    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}
    config = transformers.Qwen2VLConfig(
        text_config=dict(hidden_size=128, num_attention_heads=4, rope_parameters=rope)
    ).text_config
    positions = _positions_3d(40)
    ours = MRotaryEmbedding(32, 32, 10000.0, 128, mrope_section=(4, 6, 6), interleaved=False)
    expected = _hf_cos_sin(Qwen2VLRotaryEmbedding, config, positions)
    torch.testing.assert_close(ours.get_cos_sin(positions), expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.get_cos_sin(positions[:, None]), expected, atol=1e-6, rtol=0)


def test_interleaved_partial_mrope_matches_hf_qwen3_5() -> None:
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    rope = {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    }
    config = transformers.Qwen3_5TextConfig(
        hidden_size=128, num_attention_heads=2, head_dim=64, rope_parameters=rope
    )
    positions = _positions_3d(40)
    ours = MRotaryEmbedding(64, 16, 10000.0, 128, mrope_section=(3, 3, 2), interleaved=True)
    expected = _hf_cos_sin(Qwen3_5TextRotaryEmbedding, config, positions)
    assert expected.shape == (40, 16)
    torch.testing.assert_close(ours.get_cos_sin(positions), expected, atol=1e-6, rtol=0)


def test_apply_rotary_matches_hf_rotate_half_and_passes_tail() -> None:
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 3, 32, generator=gen)
    rope = RotaryEmbedding(32, 16, 10000.0, 64)
    cos_sin = rope.get_cos_sin(torch.tensor([0, 4, 9, 2, 33]))
    cos = torch.cat([cos_sin[:, :8]] * 2, -1)
    sin = torch.cat([cos_sin[:, 8:]] * 2, -1)
    expected_rot, _ = apply_rotary_pos_emb(q[..., :16], q[..., :16], cos, sin, unsqueeze_dim=1)
    out = apply_rotary_emb(q, cos_sin)
    torch.testing.assert_close(out[..., :16], expected_rot, atol=1e-6, rtol=0)
    assert torch.equal(out[..., 16:], q[..., 16:])


def test_built_under_meta_context_still_has_real_tables() -> None:
    with torch.device("meta"):
        rope = MRotaryEmbedding(16, 16, 10000.0, 32, mrope_section=(3, 3, 2), interleaved=True)
    assert not rope.cos_sin_table.is_meta and not rope.channel_axes.is_meta
    expected = _direct(torch.arange(4), 16, 10000.0)
    torch.testing.assert_close(rope.get_cos_sin(torch.arange(4)), expected, atol=2e-5, rtol=0)
