"""Attention module: fused qkv + per-head q/k norm + partial rotary + GQA against a dense
reference written out step by step."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "modeling"))
from paged_kv_helpers import build_metadata  # noqa: E402

from tensorrt_llm._torch.models.modeling_qwen3_next import GatedAttention  # noqa: E402
from tensorrt_llm._torch.modules import triton_kernels  # noqa: E402
from tensorrt_llm._torch.modules.attention import Attention  # noqa: E402
from tensorrt_llm._torch.modules.rotary_embedding import RotaryEmbedding  # noqa: E402
from tensorrt_llm._torch.modules.triton_kernels import mrope  # noqa: E402


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    half = dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    full_cos, full_sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    return torch.cat([rot * full_cos + rotated * full_sin, rest], -1)


@pytest.fixture(params=["torch", "triton"])
def rope_backend(request, monkeypatch) -> str:
    """Run the module's fused norm+rope call on its torch path, or on the Triton kernel (the
    interpreter on CPU), which is what CUDA runs: checks the module's wiring of the kernel."""
    if request.param == "triton":
        if not triton_kernels.HAS_TRITON or (
            not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
        ):
            pytest.skip("needs triton (the interpreter on CPU)")
        monkeypatch.setattr(mrope, "use_triton", lambda name, device, backend: True)
    return request.param


@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_module_matches_dense_reference(qk_norm: bool, rope_backend: str) -> None:
    heads, kv_heads, head_dim, hidden, rotary_dim, length = 4, 2, 16, 32, 8, 9
    attn = Attention(hidden, heads, kv_heads, head_dim, 0, qkv_bias=True, qk_norm=qk_norm)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(length, hidden, generator=gen)
    cos_sin = RotaryEmbedding(head_dim, rotary_dim, 10000.0, 64).get_cos_sin(torch.arange(length))
    with torch.no_grad():
        got = attn(x, cos_sin, build_metadata(None, [(0, length, 0)]))

        q, k, v = attn.qkv_proj(x).split(
            [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1
        )
        q, k = q.view(length, heads, head_dim), k.view(length, kv_heads, head_dim)
        if qk_norm:
            q, k = attn.q_norm(q), attn.k_norm(k)
        cos, sin = cos_sin[:, : rotary_dim // 2], cos_sin[:, rotary_dim // 2 :]
        q, k = _rotate(q, cos, sin, rotary_dim), _rotate(k, cos, sin, rotary_dim)
        k = k.repeat_interleave(2, 1)
        v = v.view(length, kv_heads, head_dim).repeat_interleave(2, 1)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        expected = attn.o_proj(out.transpose(0, 1).reshape(length, -1))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows"):
        attn(x, cos_sin[:-1], build_metadata(None, [(0, length, 0)]))


def test_gated_attention_fused_norm_rope_matches_torch_path(monkeypatch) -> None:
    """Qwen3.5's gated attention: zero-centered q/k norms run inside the rope kernel on q, a
    strided view that skips the gate rows; the Triton path (interpreter on CPU) must give the
    torch path's output. Partial rotary (8 of 16 dims)."""
    if not triton_kernels.HAS_TRITON or (
        not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    ):
        pytest.skip("needs triton (the interpreter on CPU)")
    config = SimpleNamespace(
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_size=32,
        rms_norm_eps=1e-6, attention_bias=False,
    )  # fmt: skip
    attn = GatedAttention(config, 0, "vanilla", None)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    length = 7
    x = torch.randn(length, 32, generator=gen)
    cos_sin = RotaryEmbedding(16, 8, 10000.0, 64).get_cos_sin(torch.arange(length))
    with torch.no_grad():
        want = attn(x, cos_sin, build_metadata(None, [(0, length, 0)]))
        monkeypatch.setattr(mrope, "use_triton", lambda name, device, backend: True)
        got = attn(x, cos_sin, build_metadata(None, [(0, length, 0)]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
