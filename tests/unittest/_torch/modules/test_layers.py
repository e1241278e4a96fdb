"""RMSNorm, Linear, Embedding/LMHead and GatedMLP against reference computations."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from tensorrt_llm._torch.modules.embedding import Embedding, LMHead
from tensorrt_llm._torch.modules.gated_mlp import GatedMLP
from tensorrt_llm._torch.modules.linear import Linear
from tensorrt_llm._torch.modules.rms_norm import RMSNorm
from tensorrt_llm._torch.weight_loading import load_hf_weights


def _rand(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x = _rand(7, 48, dtype=dtype) * 3
    ours = RMSNorm(48, eps=1e-5, dtype=dtype)
    hf = Qwen2RMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(_rand(48, seed=1))
        hf.weight.copy_(ours.weight)
    expected = hf(x)
    assert torch.equal(ours(x), expected)
    x64 = x.double()
    direct = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * ours.weight.double()
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(ours(x).double(), direct, atol=tol, rtol=tol)


def test_rms_norm_fused_residual() -> None:
    x, res = _rand(4, 16, seed=2), _rand(4, 16, seed=3)
    norm = RMSNorm(16)
    out, new_res = norm(x, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, norm(x + res))
    with pytest.raises(ValueError, match="last dim"):
        norm(_rand(4, 8))


def test_linear_output_splits_and_bias() -> None:
    lin = Linear(8, 6, bias=True, output_splits=(2, 4))
    with torch.no_grad():
        lin.weight.copy_(_rand(6, 8))
        lin.bias.copy_(_rand(6, seed=1))
    x = _rand(3, 8, seed=2)
    torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias)
    with pytest.raises(ValueError, match="do not sum"):
        Linear(8, 6, output_splits=(2, 3))


def test_embedding_and_tied_head() -> None:
    emb, head = Embedding(10, 4), LMHead(10, 4)
    with torch.no_grad():
        emb.weight.copy_(_rand(10, 4))
    head.tie_to(emb)
    assert head.weight is emb.weight
    ids = torch.tensor([3, 0, 9])
    assert torch.equal(emb(ids), emb.weight[ids])
    torch.testing.assert_close(head(emb(ids)), emb.weight[ids] @ emb.weight.T)
    with pytest.raises(ValueError, match="cannot tie"):
        LMHead(11, 4).tie_to(emb)


def test_gated_mlp_loads_hf_gate_up_and_matches() -> None:
    config = Qwen2Config(hidden_size=16, intermediate_size=24)
    hf = Qwen2MLP(config)
    with torch.no_grad():
        for i, p in enumerate(hf.parameters()):
            p.copy_(_rand(*p.shape, seed=10 + i))
    ours = GatedMLP(16, 24)
    load_hf_weights(ours, hf.state_dict())
    x = _rand(5, 16, seed=20)
    torch.testing.assert_close(ours(x), hf(x), atol=1e-6, rtol=1e-6)
