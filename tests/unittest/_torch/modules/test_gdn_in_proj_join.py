"""The Gated DeltaNet input projections are joined by a post-load step, not by the forward:
the engine's `build_model` joins every layer's `[in_proj_qkvz; in_proj_ba]` before the first
step, a model loaded without that step runs the two GEMMs (same logits) and never joins on
its own, and the step refuses to run inside a torch.compile trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet, GatedDeltaNetMetadata
from tensorrt_llm._torch.modules.gated_delta_net_weights import fuse_in_projections_
from tensorrt_llm._torch.pyexecutor.model_build import build_model, model_config_of
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


def _gdns(model: torch.nn.Module) -> list[GatedDeltaNet]:
    return [m for m in model.modules() if isinstance(m, GatedDeltaNet)]


def _run_layers(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each DeltaNet layer on the same prefill + decode rows (its own zero state)."""
    meta = GatedDeltaNetMetadata((5, 3), (False, False), 1)
    out = []
    for gdn in _gdns(model):
        x = torch.randn(9, gdn.hidden_size, generator=torch.Generator().manual_seed(1))
        conv, ssm = torch.zeros(3, *gdn.conv_state_shape), torch.zeros(3, *gdn.ssm_state_shape)
        with torch.no_grad():
            out.append(gdn(x, conv, ssm, meta))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3_next", tmp_path_factory.mktemp("join") / "next")


def test_the_engine_joins_before_the_first_forward_and_direct_loads_do_not(ckpt: Path) -> None:
    config = LlmArgs(model=str(ckpt), device="cpu", max_batch_size=2).to_engine_config()
    cls: Any = get_model_class(config.architecture)
    built = build_model(cls, model_config_of(config), torch.device("cpu"), config)
    gdns = _gdns(built)
    assert gdns and all(g.in_proj_fused is not None for g in gdns)  # no forward has run yet
    for g in gdns:
        rows = g.in_proj_qkvz.weight.shape[0]
        assert g.in_proj_qkvz.weight.data_ptr() == g.in_proj_fused.data_ptr()
        assert torch.equal(g.in_proj_fused[rows:], g.in_proj_ba.weight)

    pretrained = load_pretrained_config(ckpt)
    direct = load_model(cls, ModelConfig(pretrained, checkpoint_dir=str(ckpt)), "cpu")
    assert all(g.in_proj_fused is None for g in _gdns(direct))
    two_gemms = _run_layers(direct)
    # The forward decides nothing: still two GEMMs after it ran.
    assert all(g.in_proj_fused is None for g in _gdns(direct))
    for got, want in zip(two_gemms, _run_layers(built), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_step_refuses_a_compile_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    gdn = GatedDeltaNet(32, 2, 4, 8, 8)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(RuntimeError, match="post-load step"):
        fuse_in_projections_(gdn)
    assert gdn.in_proj_fused is None


def test_fp8_quantization_comes_before_the_join(ckpt: Path) -> None:
    # quantization="fp8" replaces the in-projections by e4m3 ones: joined before that, the
    # forward would run the stale 16-bit copy (and keep it in memory beside the fp8 weights).
    config = LlmArgs(
        model=str(ckpt), device="cpu", max_batch_size=2, quantization="fp8"
    ).to_engine_config()
    cls: Any = get_model_class(config.architecture)
    built = build_model(cls, model_config_of(config), torch.device("cpu"), config)
    gdns = _gdns(built)
    assert gdns
    for g in gdns:
        assert g.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn
        assert g.in_proj_fused is None or g.in_proj_fused.dtype == torch.float8_e4m3fn
