"""HF parity of the Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 vision towers (tiny fp32 configs)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tensorrt_llm._torch.models import modeling_qwen_vision_common as common
from tensorrt_llm._torch.models.modeling_qwen2vl_vision import (
    Qwen2_5_VisionModel,
    Qwen2VisionModel,
    window_layout,
)
from tensorrt_llm._torch.models.modeling_qwen3vl_vision import (
    Qwen3VisionModel,
    interpolate_pos_embed_reference,
)
from tensorrt_llm._torch.models.modeling_qwen_vision_common import VisionRotaryTable
from tensorrt_llm._torch.modules.vision_attention import VarlenSegments, varlen_attention

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_q25  # noqa: E402
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf_q2  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_q35  # noqa: E402
from transformers.models.qwen3_vl import modeling_qwen3_vl as hf_q3  # noqa: E402

GRIDS = {
    "image": [[1, 4, 6]],
    "two_images": [[1, 4, 6], [1, 6, 8]],
    "video": [[3, 4, 4]],
    "mixed": [[2, 6, 4], [1, 2, 2], [1, 10, 14]],
}


def _tiny(family: str) -> tuple[Any, type, type]:
    """(HF vision config, HF vision class, our tower class) for a tiny random tower."""
    common_kw: dict[str, Any] = dict(
        depth=2, num_heads=2, spatial_merge_size=2, temporal_patch_size=2
    )
    if family == "qwen2":
        cfg = hf_q2.Qwen2VLVisionConfig(
            embed_dim=32, hidden_size=64, mlp_ratio=2, patch_size=14, **common_kw
        )
        return cfg, hf_q2.Qwen2VisionTransformerPretrainedModel, Qwen2VisionModel
    if family == "qwen2_5":
        cfg = hf_q25.Qwen2_5_VLVisionConfig(
            hidden_size=32, intermediate_size=48, out_hidden_size=64, patch_size=14,
            window_size=56, fullatt_block_indexes=[1], **common_kw,
        )  # fmt: skip
        return cfg, hf_q25.Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VisionModel
    kw = dict(hidden_size=32, intermediate_size=48, out_hidden_size=64, patch_size=16)
    kw.update(num_position_embeddings=64, **common_kw)
    if family == "qwen3":
        cfg = hf_q3.Qwen3VLVisionConfig(deepstack_visual_indexes=[0], **kw)
        return cfg, hf_q3.Qwen3VLVisionModel, Qwen3VisionModel
    cfg = hf_q35.Qwen3_5VisionConfig(**kw)
    return cfg, hf_q35.Qwen3_5VisionModel, Qwen3VisionModel


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace HF's tiny init by O(0.1) weights so differences are visible; norms near 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * 0.1
            is_norm_scale = name.endswith("weight") and ("norm" in name or "ln_q" in name)
            p.copy_(noise + 1.0 if is_norm_scale and p.dim() == 1 else noise)


_MODEL_CACHE: dict[str, tuple[torch.nn.Module, torch.nn.Module]] = {}


def _pair(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(HF tower, our tower) holding the same random weights; built once per family."""
    if family not in _MODEL_CACHE:
        torch.manual_seed(0)
        cfg, hf_cls, our_cls = _tiny(family)
        hf = hf_cls._from_config(cfg).eval()
        _randomize(hf, seed=1)
        ours = our_cls(cfg, dtype=torch.float32, attn_backend="sdpa").eval()
        ours.load_weights(dict(hf.state_dict()))
        _MODEL_CACHE[family] = (hf, ours)
    return _MODEL_CACHE[family]


def _hf_outputs(out: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Merged embeddings and deepstack list from any HF tower return convention."""
    if hasattr(out, "pooler_output"):
        return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])
    if isinstance(out, tuple):
        return out[0], list(out[1])
    return out, []


def _pixels(grid: torch.Tensor, patch_dim: int, seed: int = 0) -> torch.Tensor:
    n = int((grid[:, 0] * grid[:, 1] * grid[:, 2]).sum())
    return torch.randn(n, patch_dim, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("grid_name", list(GRIDS))
@pytest.mark.parametrize("family", ["qwen2", "qwen2_5", "qwen3", "qwen3_5"])
def test_tower_matches_hf(family: str, grid_name: str) -> None:
    hf, ours = _pair(family)
    grid = torch.tensor(GRIDS[grid_name])
    pixels = _pixels(grid, ours.patch_embed.patch_dim)
    with torch.no_grad():
        ref, ref_deep = _hf_outputs(hf(pixels, grid_thw=grid))
        out = ours(pixels, grid)
    merge = ours.merge
    assert out.embeddings.shape == (pixels.shape[0] // merge**2, 64)
    assert ref.abs().mean() > 0.05  # the comparison is not between near-zero tensors
    torch.testing.assert_close(out.embeddings, ref, atol=1e-4, rtol=1e-4)
    expected_deep = 1 if family == "qwen3" else 0
    assert len(out.deepstack_embeddings) == len(ref_deep) == expected_deep
    for got, want in zip(out.deepstack_embeddings, ref_deep, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def _hf_pos_embed(hf: torch.nn.Module, grid: torch.Tensor) -> torch.Tensor:
    if hasattr(hf, "fast_pos_embed_interpolate"):  # transformers < 5.2x
        return hf.fast_pos_embed_interpolate(grid)
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    idx, w = get_vision_interpolation_indices_and_weights(
        grid, hf.num_grid_per_side, mode="bilinear", align_corners=True,
        spatial_merge_size=hf.config.spatial_merge_size,
    )  # fmt: skip
    return (hf.pos_embed(idx) * w[:, :, None]).sum(1)


@pytest.mark.parametrize("grid_name", list(GRIDS))
def test_pos_embed_reference_matches_hf_and_fast_path(grid_name: str) -> None:
    hf, ours = _pair("qwen3")
    grid = torch.tensor(GRIDS[grid_name])
    with torch.no_grad():
        ref = interpolate_pos_embed_reference(ours.pos_embed.weight, grid, 8, 2)
        want = _hf_pos_embed(hf, grid)
        inputs = ours.prepare_inputs(common.validate_grid_thw(grid, 2), torch.device("cpu"))
        fast = ours.interpolate_pos_embed(inputs)
    torch.testing.assert_close(ref, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)


def test_pos_embed_reference_edge_grids() -> None:
    """h or w == merge (one row of taps) and grids larger than the learned table."""
    weight = torch.randn(64, 8)
    table = weight.view(8, 8, 8)
    out = interpolate_pos_embed_reference(weight, torch.tensor([[1, 2, 8]]), 8, 2)
    # Row 0 maps to table row 0, row 1 (of 2) to row 7; w == side samples columns exactly.
    want = torch.stack([table[0], table[7]]).view(1, 2, 4, 2, 8).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(out, want.reshape(16, 8))
    big = interpolate_pos_embed_reference(weight, torch.tensor([[2, 16, 30]]), 8, 2)
    assert big.shape == (2 * 16 * 30, 8)


def test_window_layout_matches_hf() -> None:
    vision_utils = pytest.importorskip("transformers.vision_utils")
    if not hasattr(vision_utils, "get_vision_window_index"):
        pytest.skip("this transformers has no get_vision_window_index")
    for t, h, w in [(1, 4, 6), (2, 10, 14), (1, 8, 8), (1, 2, 2)]:
        index, lens = window_layout(t, h, w, merge=2, window=2)
        want_index, want_cu = vision_utils.get_vision_window_index(
            torch.tensor([[t, h, w]]), spatial_merge_size=2, window_size=56, patch_size=14
        )
        assert torch.equal(index, want_index)
        assert torch.equal(VarlenSegments.host_cu_seqlens(lens), want_cu)


@pytest.mark.parametrize("backend", ["sdpa", "mask", "auto"])
def test_varlen_attention_matches_per_segment_loop(backend: str) -> None:
    gen = torch.Generator().manual_seed(3)
    lens = [5, 5, 5, 3, 7, 7, 1]
    q, k, v = (torch.randn(sum(lens), 2, 8, generator=gen) for _ in range(3))
    out = varlen_attention(q, k, v, VarlenSegments.from_seqlens(lens), backend)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        scores = torch.einsum("qhd,khd->hqk", q[sl], k[sl]) / 8**0.5
        want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[sl])
        torch.testing.assert_close(out[sl], want, atol=1e-5, rtol=1e-5)
        start += n
    assert VarlenSegments.from_seqlens(lens).runs == ((0, 5, 3), (15, 3, 1), (18, 7, 2), (32, 1, 1))


def test_rotary_table_grows_and_matches_direct() -> None:
    table = VisionRotaryTable(head_dim=16, theta=10000.0, max_side=4)
    table.ensure_side(11)
    assert table.max_side >= 11
    pos = torch.tensor([[0, 3], [10, 7]], dtype=torch.int32)
    cos, sin = table(pos)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    ang = torch.cat([pos[:, :1].float() * inv, pos[:, 1:].float() * inv], dim=-1)
    torch.testing.assert_close(cos, torch.cat([ang.cos(), ang.cos()], -1))
    torch.testing.assert_close(sin, torch.cat([ang.sin(), ang.sin()], -1))


@pytest.mark.parametrize("family", ["qwen2", "qwen2_5", "qwen3"])
def test_forward_is_cached_single_h2d_and_trig_free(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ours = _pair(family)
    grid = torch.tensor(GRIDS["mixed"])
    pixels = _pixels(grid, ours.patch_embed.patch_dim)
    with torch.no_grad():
        first = ours(pixels, grid).embeddings  # warm the per-grid cache
    cached = dict(ours._grid_cache)
    calls: list[int] = []
    real_h2d: Callable[..., torch.Tensor] = common.async_tensor_h2d
    monkeypatch.setattr(
        common, "async_tensor_h2d", lambda *a, **k: calls.append(1) or real_h2d(*a, **k)
    )

    def _no_trig(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("cos/sin computed inside forward")

    monkeypatch.setattr(torch.Tensor, "cos", _no_trig)
    monkeypatch.setattr(torch.Tensor, "sin", _no_trig)
    with torch.no_grad():
        again = ours(pixels, grid).embeddings
    assert len(calls) == 1
    assert all(ours._grid_cache[key] is val for key, val in cached.items())
    torch.testing.assert_close(again, first, atol=0, rtol=0)


def test_bad_inputs_raise_clear_errors() -> None:
    _, ours = _pair("qwen2")
    dim = ours.patch_embed.patch_dim
    with pytest.raises(ValueError, match="divisible by spatial_merge_size"):
        ours(torch.randn(15, dim), torch.tensor([[1, 3, 5]]))
    with pytest.raises(ValueError, match="patches but grid_thw"):
        ours(torch.randn(10, dim), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match=r"shape \[num_items>0, 3\]"):
        ours(torch.randn(16, dim), torch.tensor([1, 4, 4]))
    with pytest.raises(ValueError, match="integer"):
        ours(torch.randn(16, dim), torch.tensor([[1.0, 4.0, 4.0]]))
    with pytest.raises(ValueError, match=rf"\[N_patches, {dim}\]"):
        ours(torch.randn(16, 7), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="unknown vision attention backend"):
        varlen_attention(
            *(torch.randn(4, 1, 4) for _ in range(3)), VarlenSegments.from_seqlens([4]), "x"
        )


def test_load_weights_names_missing_and_unexpected_keys() -> None:
    hf, ours = _pair("qwen3")
    weights = dict(hf.state_dict())
    weights.pop("blocks.1.attn.qkv.bias")
    weights["visual.blocks.0.attn.qkv.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.qkv\.bias.*visual\.blocks\.0"):
        ours.load_weights(weights)
    bad_shape = dict(hf.state_dict())
    bad_shape["pos_embed.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="pos_embed.weight has shape"):
        ours.load_weights(bad_shape)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen2_5", "qwen3"])
def test_tower_bf16_cuda_matches_fp32_cpu(family: str) -> None:
    cfg, _, our_cls = _tiny(family)
    _, ours_cpu = _pair(family)
    gpu = our_cls(cfg, dtype=torch.bfloat16, attn_backend="auto").cuda()
    gpu.load_weights(dict(ours_cpu.named_parameters()))
    for grid_name in GRIDS:
        grid = torch.tensor(GRIDS[grid_name])
        pixels = _pixels(grid, ours_cpu.patch_embed.patch_dim, seed=5)
        with torch.no_grad():
            want = ours_cpu(pixels, grid)
            got = gpu(pixels.cuda(), grid)
        scale = want.embeddings.abs().max().item()
        torch.testing.assert_close(
            got.embeddings.float().cpu(), want.embeddings, atol=0.05 * scale, rtol=0.05
        )
        for g, w in zip(got.deepstack_embeddings, want.deepstack_embeddings, strict=True):
            torch.testing.assert_close(g.float().cpu(), w, atol=0.05 * scale, rtol=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen2_5", "qwen3"])
def test_tower_forward_does_not_sync_on_cuda(family: str) -> None:
    """Steady state (tables cached, kernels compiled): a tower call never waits for the GPU.
    Grids live on the host, pixels arrive on the device, and every index table is host-built
    and copied asynchronously, so prefill of the next step can be prepared meanwhile."""
    cfg, _, our_cls = _tiny(family)
    tower = our_cls(cfg, dtype=torch.bfloat16, attn_backend="auto").cuda()
    _randomize(tower, seed=1)
    grid = torch.tensor(GRIDS["mixed"])
    pixels = _pixels(grid, tower.patch_embed.patch_dim).cuda().bfloat16()
    with torch.no_grad():
        tower(pixels, grid)  # warm: rotary tables, Triton compiles, pinned buffers
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = tower(pixels, grid)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert out.embeddings.shape[0] == int(grid.prod(-1).sum()) // cfg.spatial_merge_size**2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_varlen_attention_cuda_bf16_matches_mask_reference(backend: str) -> None:
    gen = torch.Generator().manual_seed(4)
    lens = [64, 64, 16, 100, 1]
    q, k, v = (torch.randn(sum(lens), 4, 64, generator=gen) for _ in range(3))
    cu = VarlenSegments.host_cu_seqlens(lens).cuda()
    seg = VarlenSegments.from_seqlens(lens, cu)
    got = varlen_attention(*(x.cuda().bfloat16() for x in (q, k, v)), seg, backend)
    want = varlen_attention(q, k, v, VarlenSegments.from_seqlens(lens), "mask")
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)
