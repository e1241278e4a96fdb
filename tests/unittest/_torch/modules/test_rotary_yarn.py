"""YaRN rope scaling: our cos/sin tables, and q/k rotated by the fused (m)RoPE kernel, against
HF transformers' rotary classes for the same config (text RoPE and contiguous / interleaved
mRoPE); parsing errors for unsupported rope types and keys."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from tensorrt_llm._torch.models.modeling_qwen2 import build_rotary_embedding
from tensorrt_llm._torch.modules.rotary_embedding import (
    MRotaryEmbedding,
    RotaryEmbedding,
    YarnScaling,
    parse_rope_scaling,
)
from tensorrt_llm._torch.modules.triton_kernels import HAS_TRITON
from tensorrt_llm._torch.modules.triton_kernels.mrope import apply_rotary_qk_

MAX_POS = 256
# The Triton kernel runs compiled on a GPU, else under TRITON_INTERPRET (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Each variant exercises one branch of HF's `_compute_yarn_parameters`.
YARN_VARIANTS: dict[str, dict[str, Any]] = {
    "factor": {"factor": 4.0, "original_max_position_embeddings": 64},
    "betas_no_truncate": {
        "factor": 2.0,
        "original_max_position_embeddings": 100,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "mscale_pair": {
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "mscale_alone_is_ignored": {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "mscale": 0.5,
    },
    "attention_factor": {
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "attention_factor": 1.5,
    },
    "factor_from_lengths": {"factor": None, "original_max_position_embeddings": 64},
}


def _yarn(variant: str, **extra: Any) -> dict[str, Any]:
    return {"rope_type": "yarn", **YARN_VARIANTS[variant], **extra}


def _text_config(family: str, rope: dict[str, Any]) -> Any:
    """An HF text config of `family` with `rope` merged into its rope parameters."""
    common = dict(hidden_size=64, num_attention_heads=4, max_position_embeddings=MAX_POS)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, rope_parameters={"rope_theta": 1e6, **rope})
    if family == "qwen3":
        # Legacy layout: `rope_scaling` plus a top-level `rope_theta`, as Qwen3 hub configs.
        return transformers.Qwen3Config(**common, head_dim=32, rope_theta=1e6, rope_scaling=rope)
    if family == "qwen2_vl":
        params = {"rope_theta": 1e4, "mrope_section": [2, 3, 3], **rope}
        return transformers.Qwen2VLConfig(
            text_config=dict(**common, rope_parameters=params)
        ).text_config
    if family == "qwen3_vl":
        params = {"rope_theta": 5e6, "mrope_section": [3, 3, 2], "mrope_interleaved": True}
        return transformers.Qwen3VLConfig(
            text_config=dict(**common, head_dim=16, rope_parameters={**params, **rope})
        ).text_config
    assert family == "qwen3_5"
    params = {
        "rope_theta": 1e7,
        "mrope_section": [3, 3, 2],
        "mrope_interleaved": True,
        "partial_rotary_factor": 0.25,
    }
    return transformers.Qwen3_5TextConfig(**common, head_dim=64, rope_parameters={**params, **rope})


def _hf_rotary(family: str, config: Any) -> torch.nn.Module:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    classes = {
        "qwen2": Qwen2RotaryEmbedding,
        "qwen3": Qwen3RotaryEmbedding,
        "qwen2_vl": Qwen2VLRotaryEmbedding,
        "qwen3_vl": Qwen3VLTextRotaryEmbedding,
        "qwen3_5": Qwen3_5TextRotaryEmbedding,
    }
    return classes[family](config)


MROPE = ("qwen2_vl", "qwen3_vl", "qwen3_5")
FAMILIES = ("qwen2", "qwen3", *MROPE)


def _positions(family: str, length: int) -> torch.Tensor:
    """`[T]` for text RoPE, `[3, T]` for mRoPE; spans past `original_max_position_embeddings`."""
    ar = torch.arange(length) * 3  # up to ~MAX_POS
    if family not in MROPE:
        return ar
    return torch.stack([ar, (2 * ar) // 3, (5 * ar) % 97])


def _hf_cos_sin(hf: torch.nn.Module, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's `(cos, sin)` `[T, rotary_dim]` for our position layout."""
    pos = positions[:, None] if positions.dim() == 2 else positions[None]
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), pos)
    return cos[0], sin[0]


@pytest.mark.parametrize("variant", tuple(YARN_VARIANTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_yarn_tables_match_hf(family: str, variant: str) -> None:
    config = _text_config(family, _yarn(variant))
    ours = build_rotary_embedding(config)
    hf = _hf_rotary(family, config)
    assert isinstance(ours, MRotaryEmbedding) == (family in MROPE)
    assert ours.scaling is not None
    torch.testing.assert_close(ours.inv_freq, hf.inv_freq, atol=0, rtol=0)
    assert ours.attention_scaling == pytest.approx(hf.attention_scaling, rel=1e-12)
    positions = _positions(family, 80)
    cos, sin = _hf_cos_sin(hf, positions)
    half = ours.rotary_dim // 2
    expected = torch.cat([cos[:, :half], sin[:, :half]], dim=-1)
    torch.testing.assert_close(ours.get_cos_sin(positions), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("variant", ("factor", "mscale_pair"))
def test_yarn_changes_the_frequencies(variant: str) -> None:
    """The test above can fail: YaRN tables differ from the plain ones (low frequencies are
    interpolated, and the attention factor scales every entry)."""
    plain = build_rotary_embedding(_text_config("qwen3_vl", {"rope_type": "default"}))
    yarn = build_rotary_embedding(_text_config("qwen3_vl", _yarn(variant)))
    assert torch.equal(yarn.inv_freq[:1], plain.inv_freq[:1])  # fastest: extrapolated as is
    assert bool((yarn.inv_freq[-1] < plain.inv_freq[-1]).all())  # slowest: interpolated
    assert yarn.attention_scaling != 1.0
    assert not torch.allclose(yarn.cos_sin_table, plain.cos_sin_table)


BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="x"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", ("qwen3", "qwen2_vl", "qwen3_5"))
def test_fused_rope_kernel_reads_the_scaled_tables(family: str, backend: str) -> None:
    """q/k rotated in place by `rope_qk_` equal HF's `apply_rotary_pos_emb` with HF's scaled
    cos/sin (so the attention factor reaches q.k squared)."""
    from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

    config = _text_config(family, _yarn("mscale_pair"))
    ours = build_rotary_embedding(config)
    positions = _positions(family, 12)
    cos, sin = _hf_cos_sin(_hf_rotary(family, config), positions)
    head_dim, rotary = ours.head_dim, ours.rotary_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(12, 4, head_dim, generator=gen)
    k = torch.randn(12, 2, head_dim, generator=gen)
    exp_q, exp_k = apply_rotary_pos_emb(
        q[..., :rotary].transpose(0, 1), k[..., :rotary].transpose(0, 1), cos, sin, 0
    )
    got_q, got_k = apply_rotary_qk_(
        ours.to(DEVICE), q.to(DEVICE), k.to(DEVICE), positions.to(DEVICE), backend=backend
    )
    got_q, got_k = got_q.cpu(), got_k.cpu()
    torch.testing.assert_close(got_q[..., :rotary], exp_q.transpose(0, 1), atol=1e-5, rtol=0)
    torch.testing.assert_close(got_k[..., :rotary], exp_k.transpose(0, 1), atol=1e-5, rtol=0)
    assert torch.equal(got_q[..., rotary:], q[..., rotary:])


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "llama3", "longrope"])
def test_unsupported_rope_type_names_it_and_the_supported_ones(rope_type: str) -> None:
    rope = {"rope_type": rope_type, "factor": 2.0}
    with pytest.raises(ValueError, match=rf"'{rope_type}'.*default, mrope, yarn"):
        parse_rope_scaling(rope, MAX_POS)
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4)
    config.rope_parameters = {"rope_theta": 1e4, **rope}
    with pytest.raises(ValueError, match="unsupported rope_type"):
        build_rotary_embedding(config)


def test_yarn_parse_errors_and_defaults() -> None:
    with pytest.raises(ValueError, match=r"unsupported rope_scaling keys \['low_freq_factor'\]"):
        parse_rope_scaling({**_yarn("factor"), "low_freq_factor": 1.0}, MAX_POS)
    with pytest.raises(ValueError, match="needs a 'factor'"):
        parse_rope_scaling({"rope_type": "yarn"}, MAX_POS)
    with pytest.raises(ValueError, match="must be a number"):
        parse_rope_scaling({"rope_type": "yarn", "factor": "4"}, MAX_POS)
    # Legacy `type`, no original length anywhere: HF falls back to max_position_embeddings,
    # and a config's top-level field wins over the dict's.
    assert parse_rope_scaling({"type": "yarn", "factor": 2}, MAX_POS) == YarnScaling(2.0, MAX_POS)
    top = parse_rope_scaling(_yarn("factor"), MAX_POS, original_max_position_embeddings=128)
    assert top is not None and top.original_max_positions == 128
    assert parse_rope_scaling({"type": "mrope", "mrope_section": [1, 2, 3]}, MAX_POS) is None
    assert parse_rope_scaling({}, MAX_POS) is None


def test_default_tables_are_unchanged_by_the_scaling_hook() -> None:
    """No behaviour change without YaRN: same inverse frequencies, unscaled table."""
    rope = RotaryEmbedding(32, 32, 1e6, 64)
    exponent = torch.arange(0, 32, 2).float()
    assert torch.equal(rope.inv_freq, 1.0 / (1e6 ** (exponent / 32)))
    assert rope.scaling is None and rope.attention_scaling == 1.0
    cos, sin = rope.cos_sin_table.chunk(2, dim=-1)
    torch.testing.assert_close(cos * cos + sin * sin, torch.ones_like(cos), atol=1e-6, rtol=0)
