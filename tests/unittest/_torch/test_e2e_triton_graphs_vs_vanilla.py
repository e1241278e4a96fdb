"""End to end on CUDA: the fast path (Triton attention + decode CUDA graphs + overlap scheduler)
gives the same greedy tokens as the torch reference path (vanilla attention, eager), per family.

fp32 keeps both paths within rounding of each other, so greedy tokens agree exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.inputs.utils import VideoData
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen_image_bench",
)
IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")


def _inputs() -> list:
    from PIL import Image

    frames = [Image.open(IMAGE).convert("RGB").resize((56, 56)) for _ in range(4)]
    return [
        "a text-only request about the weather",
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "image"}, {"type": "text", "text": "describe"}],
                }
            ],
            "multi_modal_data": {"image": [IMAGE]},
        },
        {
            "prompt": [
                {
                    "role": "user",
                    "content": [{"type": "video"}, {"type": "text", "text": "what happens"}],
                }
            ],
            "multi_modal_data": {"video": [VideoData(frames=frames, fps=2.0)]},
        },
    ]


def _greedy(ckpt: Path, fast: bool) -> list[list[int]]:
    kwargs = (
        dict(attn_backend="triton")
        if fast
        else dict(attn_backend="vanilla", cuda_graph_config=None, disable_overlap_scheduler=True)
    )
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # inproc: a caller monkeypatches the kernels' PDL switch, which the engine must see.
    with LLM(
        model=str(ckpt), device="cuda", dtype="float32", max_batch_size=4,
        executor_mode="inproc", **kwargs,
    ) as llm:  # fmt: skip
        return [o.outputs[0].token_ids for o in llm.generate(_inputs(), params, use_tqdm=False)]


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_fast_path_matches_reference_path(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    assert _greedy(ckpt, fast=True) == _greedy(ckpt, fast=False)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_fast_path_with_pdl_matches_reference_path(
    family: str, tmp_path: Path, monkeypatch
) -> None:
    """The decode-step kernels launched with programmatic dependent launch (the default on
    sm90+), in eager steps and inside the CUDA graphs."""
    from tensorrt_llm._torch.modules import triton_kernels

    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    reference = _greedy(ckpt, fast=False)
    monkeypatch.setattr(triton_kernels, "PDL_REQUESTED", True)
    assert triton_kernels.pdl_launch_kwargs(torch.device("cuda"), 64)["USE_PDL"]
    assert _greedy(ckpt, fast=True) == reference


@pytest.mark.gpu
def test_fp8_bf16_with_pdl_generates_the_same_tokens(tmp_path: Path, monkeypatch) -> None:
    """The FP8 decode path (tensor-wise GEMMs, rescale and scaled-SwiGLU kernels, fp8 KV) in
    bf16 with CUDA graphs: PDL changes when kernels start, never what they compute."""
    from tensorrt_llm._torch.modules import triton_kernels

    ckpt = write_tiny_checkpoint("qwen3_vl", tmp_path / "qwen3_vl")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run() -> list[list[int]]:
        with LLM(
            model=str(ckpt), device="cuda", dtype="bfloat16", max_batch_size=4,
            quantization="fp8", kv_cache_dtype="fp8",
            executor_mode="inproc",  # the monkeypatched PDL switch must reach the engine
        ) as llm:  # fmt: skip
            outs = llm.generate(_inputs(), params, use_tqdm=False)
            return [o.outputs[0].token_ids for o in outs]

    monkeypatch.setattr(triton_kernels, "PDL_REQUESTED", False)  # TRTLLM_PDL=0
    without = run()
    monkeypatch.setattr(triton_kernels, "PDL_REQUESTED", True)
    assert run() == without


@pytest.mark.gpu
@pytest.mark.parametrize(
    "family", ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
)
def test_piecewise_prefill_graphs_match_reference_path(family: str, tmp_path: Path) -> None:
    """Piecewise graphs are on by default for the Qwen-VL models (dense, MoE: the Triton grouped
    GEMM inside the pieces; hybrid Qwen3.5: each DeltaNet mixer run eagerly between them, with
    its recurrent state carried across chunks and into the decode graphs): prefill and mixed steps
    (the third request's prefill joins the second's decode once the first stops) replay them;
    a second round with other prompts replays the same buckets with changed inputs. Greedy
    tokens equal the eager vanilla path. Qwen3-VL's image and video steps carry deepstack
    inputs through the graphs' static buffers, and the text-only round after them reads zeros
    there."""
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 16, 16)]
    rounds = [_inputs(), ["the weather again, in other words", "hello", "a third text prompt"]]

    def run(**kwargs) -> tuple[list[list[list[int]]], int]:
        with LLM(
            model=str(ckpt), device="cuda", dtype="float32", max_batch_size=2,
            executor_mode="inproc", **kwargs,  # the test wraps the engine's graph runner
        ) as llm:  # fmt: skip
            runner = llm._executor.model_engine.piecewise_graph_runner
            replays = []
            if runner is not None:
                real_run = runner.run
                runner.run = lambda *a: replays.append(1) or real_run(*a)
            outs = [
                [o.outputs[0].token_ids for o in llm.generate(inputs, params, use_tqdm=False)]
                for inputs in rounds
            ]
        return outs, len(replays)

    reference, _ = run(
        attn_backend="vanilla", cuda_graph_config=None, disable_overlap_scheduler=True
    )
    got, replays = run(attn_backend="triton")
    assert got == reference
    assert replays >= 4  # at least two piecewise steps per round


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe", "qwen3_vl_moe"])
def test_piecewise_chunked_prefill_matches_reference_path(family: str, tmp_path: Path) -> None:
    """Long prompts in 64-token chunks (buckets 16..64): each later chunk of a hybrid stack
    replays the pieces with its DeltaNet layers starting from the state the previous chunk
    left in the slot; chunks join decode rows in mixed steps. Greedy tokens equal eager."""
    ckpt = write_tiny_checkpoint(family, tmp_path / family)
    long = " ".join(["the weather report for the coming week, day by day"] * 12)
    prompts = [long, "hello", long + " and the next"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 8, 8)]

    def run(**kwargs) -> tuple[list[list[int]], int]:
        with LLM(
            model=str(ckpt), device="cuda", dtype="float32", max_batch_size=2,
            max_num_tokens=64, executor_mode="inproc", **kwargs,
        ) as llm:  # fmt: skip
            runner = llm._executor.model_engine.piecewise_graph_runner
            replays = []
            if runner is not None:
                real_run = runner.run
                runner.run = lambda *a: replays.append(1) or real_run(*a)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], len(replays)

    reference, _ = run(
        attn_backend="vanilla", cuda_graph_config=None, disable_overlap_scheduler=True
    )
    got, replays = run(attn_backend="triton")
    assert got == reference
    assert replays >= 6  # two long prompts of several chunks each


@pytest.mark.gpu
def test_piecewise_graphs_reject_an_ineligible_model(tmp_path: Path) -> None:
    # Dense text LLMs are not registered for piecewise graphs.
    ckpt = write_tiny_checkpoint("qwen3", tmp_path / "qwen3")
    with pytest.raises(ValueError, match="piecewise CUDA graphs: .* supports_piecewise=True"):
        LLM(model=str(ckpt), device="cuda", cuda_graph_config={"piecewise_max_tokens": 128})
    # The default: off (a log line says why); inproc: the test reads the engine's runners.
    with LLM(model=str(ckpt), device="cuda", executor_mode="inproc") as llm:
        assert llm._executor.model_engine.piecewise_graph_runner is None
        assert llm._executor.model_engine.cuda_graph_runner is not None
