"""Block-FP8 checkpoints of every family load, and behave like their dequantized 16-bit copy.

CPU, float32 compute. The reference is the same tiny checkpoint with every quantized weight
replaced by `weight * scale_inv` (tiny_checkpoint_fp8.py), loaded as a 16-bit model. Three checks:
  - exact: with the activation quantization switched off, the block-FP8 model IS the reference
    (every e4m3 weight and scale landed in the right rows, fused shards included);
  - prefill logits within a stated tolerance with the per-token-group activation quantization
    (e4m3 keeps 3 mantissa bits, so the logits move by a few percent; measured at most 7 % (rel.
    norm) on the attention models and 15 % on the 4-layer hybrid Qwen3.5 stacks);
  - greedy tokens equal over 6 steps, on a prompt (seeded ids) whose top tokens are not ties.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_block_helpers import load_engine, prefill_and_greedy, write_pair

import tensorrt_llm._torch.modules.linear as linear_mod
import tensorrt_llm._torch.modules.triton_kernels.fused_moe_ref as fused_moe_ref
from tensorrt_llm._torch.modules.fused_moe import MoE
from tensorrt_llm._torch.modules.triton_kernels.fp8_block import (
    FP8_DTYPE,
    dequantize_weight_fp8_block,
)

DENSE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen2", "qwen3", "qwen3_5_text")
MOE = ("qwen3_vl_moe", "qwen3_5_moe", "qwen3_moe")
# The fused shared expert (shared_fusion.py) in the exact check only: its tiny model's greedy
# tokens flip under the activation rounding for every prompt seed tried (1-5).
MOE_EXACT = MOE + ("qwen3_5_moe_fused",)
HYBRID = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe")
# Seed of the 12 prompt ids per family (greedy-stable under the activation rounding: with a
# hidden size of 64, one 128-column group, seeds 1-4 flip a token of qwen3_5_moe).
PROMPT_SEED = {"qwen3_5": 3, "qwen3_5_text": 3, "qwen3_5_moe": 5}
STEPS = 6
# Prefill logits, FP8 vs the dequantized reference: ||diff|| / ||ref|| and max |diff|.
REL_TOL = {"attention": 0.10, "hybrid": 0.20}
ABS_TOL = {"attention": 0.20, "hybrid": 0.35}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("fp8_block"))


def _ids(family: str) -> list[int]:
    gen = torch.Generator().manual_seed(PROMPT_SEED.get(family, 0))
    return [int(t) for t in torch.randint(0, 480, (12,), generator=gen)]


def _exact_without_activation_rounding(
    family: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fp8, ref = write_pair(family, root)
    engine = load_engine(fp8)
    linears = [m for m in engine.model.modules() if isinstance(m, linear_mod.Linear)]
    assert any(m.fp8_block is not None for m in linears)
    assert all(m.weight.dtype == FP8_DTYPE for m in linears if m.fp8_block is not None)

    def dequantized_matmul(x, weight, scale_inv, bias, block):  # type: ignore[no-untyped-def]
        w = dequantize_weight_fp8_block(weight, scale_inv, block).to(x.dtype)
        return torch.nn.functional.linear(x, w, bias)

    def dequantized_expert_matmul(x, w, scale, block):  # type: ignore[no-untyped-def]
        return x.float() @ dequantize_weight_fp8_block(w, scale, block).t()

    monkeypatch.setattr(linear_mod, "fp8_block_forward", dequantized_matmul)
    monkeypatch.setattr(fused_moe_ref, "_block_linear_fp32", dequantized_expert_matmul)
    got, _ = prefill_and_greedy(engine, fp8, _ids(family), 1)
    want, _ = prefill_and_greedy(load_engine(ref), ref, _ids(family), 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def _close_and_greedy(family: str, root: Path) -> None:
    fp8, ref = write_pair(family, root)
    got, got_tokens = prefill_and_greedy(load_engine(fp8), fp8, _ids(family), STEPS)
    want, want_tokens = prefill_and_greedy(load_engine(ref), ref, _ids(family), STEPS)
    kind = "hybrid" if family in HYBRID else "attention"
    rel = float((got - want).norm() / want.norm())
    assert rel < REL_TOL[kind], f"{family}: prefill logits off by {rel:.3f} (relative norm)"
    assert float((got - want).abs().max()) < ABS_TOL[kind]
    assert got_tokens == want_tokens


@pytest.mark.parametrize("family", DENSE)
def test_fp8_checkpoint_is_its_dequantized_copy(
    family: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _exact_without_activation_rounding(family, root, monkeypatch)


@pytest.mark.parametrize("family", DENSE)
def test_fp8_checkpoint_logits_and_greedy_tokens(family: str, root: Path) -> None:
    _close_and_greedy(family, root)


@pytest.mark.parametrize("family", MOE_EXACT)
def test_moe_fp8_checkpoint_is_its_dequantized_copy(
    family: str, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _exact_without_activation_rounding(family, root, monkeypatch)


@pytest.mark.parametrize("family", MOE)
def test_moe_fp8_checkpoint_logits_and_greedy_tokens(family: str, root: Path) -> None:
    _close_and_greedy(family, root)


def test_fp8_shared_expert_is_fused_with_its_scales(root: Path) -> None:
    """Both the shared and the routed experts are block-FP8 in a release: they fuse, scales
    included (shared_fusion.py); the 16-bit reference fuses too."""
    fp8, ref = write_pair("qwen3_5_moe_fused", root)
    for ckpt, dtype in ((fp8, FP8_DTYPE), (ref, torch.float32)):
        moes = [m for m in load_engine(ckpt).model.modules() if isinstance(m, MoE)]
        assert moes and all(m.shared_fused for m in moes)
        assert all(m.experts.gate_up_proj.dtype == dtype for m in moes)
        scales = [m.experts.gate_up_proj_scale_inv for m in moes]
        if dtype == FP8_DTYPE:
            assert all(s is not None and s.shape[0] == m.experts.num_experts
                       for s, m in zip(scales, moes, strict=True))  # fmt: skip


@pytest.mark.parametrize("family", ("qwen3", "qwen3_5"))
def test_fp8_block_on_a_16bit_checkpoint_matches_the_release_layout(
    family: str, root: Path
) -> None:
    """quantization="fp8_block" quantizes each HF shard at load exactly as the writer does."""
    fp8, _ = write_pair(family, root)
    src = root / f"{family}-16bit"
    from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

    write_tiny_checkpoint(family, src)
    converted = dict(load_engine(src, "fp8_block").model.named_parameters())
    loaded = dict(load_engine(fp8).model.named_parameters())
    assert converted.keys() == loaded.keys()
    for name, param in loaded.items():
        assert param.dtype == converted[name].dtype, name
        assert torch.equal(param.float(), converted[name].float()), name


@pytest.mark.gpu
@pytest.mark.parametrize("family", ("qwen3_vl", "qwen3_5", "qwen2"))
def test_fp8_checkpoint_on_cuda_bf16(family: str, root: Path) -> None:
    """The CUDA path (bf16 activations, the block GEMM the engine calls) on the same
    checkpoints: prefill logits near the dequantized reference on CUDA, and the executor runs."""
    assert torch.cuda.is_available()
    fp8, ref = write_pair(family, root)
    bf16 = torch.bfloat16
    got, _ = prefill_and_greedy(load_engine(fp8, device="cuda", dtype=bf16), fp8, _ids(family), 2)
    want, _ = prefill_and_greedy(load_engine(ref, device="cuda", dtype=bf16), ref, _ids(family), 2)
    kind = "hybrid" if family in HYBRID else "attention"
    rel = float((got - want).norm() / want.norm())
    assert rel < REL_TOL[kind] + 0.05, f"{family}: {rel:.3f}"  # bf16 rounding on top
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    config = LlmArgs(model=str(fp8), device="cuda", dtype="bfloat16").to_engine_config()
    assert config.quant_config is not None
    assert len(_generate(config, fp8)) == STEPS


def _generate(config: object, ckpt: Path) -> list[int]:
    from tensorrt_llm._torch.pyexecutor import py_executor_creator
    from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
    from tensorrt_llm.inputs.registry import create_input_processor
    from tensorrt_llm.sampling_params import SamplingParams

    proc = create_input_processor(str(ckpt))
    executor = py_executor_creator.create_py_executor(config, proc)  # type: ignore[arg-type]
    try:
        ids, extra = proc({"prompt_token_ids": _ids("qwen3")}, None)
        from tensorrt_llm.inputs.multimodal import MultimodalParams

        params = MultimodalParams(extra["multimodal_data"]) if extra else None
        sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
        req = LlmRequest(1, ids, sp, multimodal_params=params)
        executor.enqueue_request(req)
        while True:
            resp = executor.responses.get(timeout=120)
            assert resp.error is None, resp.error
            if resp.finished:
                return list(req.output_token_ids)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("family", ("qwen3_vl", "qwen3"))
def test_executor_loads_the_fp8_checkpoint(family: str, root: Path) -> None:
    """LlmArgs -> EngineConfig -> create_py_executor: quantization=None loads the block-FP8
    checkpoint as it is, and generates the reference's greedy tokens."""
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    fp8, ref = write_pair(family, root)
    config = LlmArgs(model=str(fp8), device="cpu").to_engine_config()
    assert config.quant_config is not None and config.quant_config.from_checkpoint
    ref_config = LlmArgs(model=str(ref), device="cpu").to_engine_config()
    assert ref_config.quant_config is None
    assert _generate(config, fp8) == _generate(ref_config, ref)


def test_dummy_weights_in_block_layout(root: Path) -> None:
    """trtllm-bench's route: load_format="dummy" + quantization="fp8_block"."""
    from tensorrt_llm._torch.pyexecutor import model_build
    from tensorrt_llm.llmapi.llm_args import LlmArgs

    fp8, _ = write_pair("qwen3_vl", root)
    _, ref = write_pair("qwen3", root)
    for ckpt in (ref, fp8):  # a 16-bit config, and one that already says block-FP8
        args = LlmArgs(model=str(ckpt), device="cpu", load_format="dummy", quantization="fp8_block")
        config = args.to_engine_config()
        model = model_build.build_model(*_route(config), torch.device("cpu"), config)
        blocks = [m for m in model.modules() if getattr(m, "fp8_block", None) is not None]
        assert blocks and all(m.weight.dtype == FP8_DTYPE for m in blocks)
        for m in blocks:
            w = dequantize_weight_fp8_block(m.weight, m.weight_scale_inv, m.fp8_block)
            assert 0.005 < float(w.std()) < 0.05  # normal(0, 0.02), not garbage or zeros
            assert torch.isfinite(w).all()
    assert _generate(config, fp8)


def _route(config: object) -> tuple[type, object]:
    from tensorrt_llm._torch.models.modeling_auto import get_model_class
    from tensorrt_llm._torch.models.modeling_utils import ModelConfig

    return get_model_class(config.architecture), ModelConfig(  # type: ignore[attr-defined]
        config.pretrained_config,  # type: ignore[attr-defined]
        max_num_seq_slots=4,
        checkpoint_dir=config.checkpoint_dir,  # type: ignore[attr-defined]
    )
