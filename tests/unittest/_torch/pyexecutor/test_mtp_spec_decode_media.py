"""MTP speculation with image and video requests (mRoPE positions with a non-zero delta),
against the engine's non-speculative greedy run: on the CPU (torch reference path) and on
CUDA (Triton attention; the reference there is the fast path with decode CUDA graphs and the
overlap scheduler). Drafts are partly right each step, so verify rows of every length and
the recurrent rollback both run at delta-shifted positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm.inputs.utils import VideoData
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
K = 3
VOCAB = 512
MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": K}


def _inputs() -> list[Any]:
    from PIL import Image

    frames = [Image.open(IMAGE).convert("RGB").resize((56, 56)) for _ in range(4)]
    image = [{"type": "image"}, {"type": "text", "text": "describe"}]
    video = [{"type": "video"}, {"type": "text", "text": "what happens"}]
    return [
        "a text-only request about the weather",
        {"prompt": [{"role": "user", "content": image}], "multi_modal_data": {"image": [IMAGE]}},
        {
            "prompt": [{"role": "user", "content": video}],
            "multi_modal_data": {"video": [VideoData(frames=frames, fps=2.0)]},
        },
    ]


def _run(ckpt: Path, engine: dict[str, Any], spec: bool, reference: Any = None) -> Any:
    """(outputs, {prompt tokens: output}, the spec stats or None)."""
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    kwargs = dict(engine)
    if spec:
        kwargs.update(speculative_config=MTP, disable_overlap_scheduler=True)
    with LLM(model=str(ckpt), executor_mode="inproc", max_batch_size=4, **kwargs) as llm:
        decoder = llm._executor.spec_decoder
        if spec and reference is not None:
            decoder.draft_override = _partly_right(reference)
        outs = llm.generate(_inputs(), params, use_tqdm=False)
        by_prompt = {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, by_prompt, None if decoder is None else decoder.stats


def _partly_right(by_prompt: dict[tuple[int, ...], list[int]]) -> Any:
    """The reference continuation, right for (generated % (K + 1)) drafts, then one off."""

    def override(req: LlmRequest, drafts: list[int]) -> list[int]:
        cont = by_prompt[tuple(int(t) for t in req.prompt_token_array)]
        done = req.num_generated_tokens
        good = done % (K + 1)
        out = []
        for j in range(len(drafts)):
            want = cont[done + j] if done + j < len(cont) else 0
            out.append(want if j < good else (want + 1) % VOCAB)
        return out

    return override


def _check(ckpt: Path, reference_engine: dict[str, Any], spec_engine: dict[str, Any]) -> None:
    reference, by_prompt, _ = _run(ckpt, reference_engine, spec=False)
    model, _, stats = _run(ckpt, spec_engine, spec=True)
    assert model == reference and stats.num_verify_rows > 0
    partly, _, stats = _run(ckpt, spec_engine, spec=True, reference=by_prompt)
    assert partly == reference
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and stats.num_replays > 0


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_media_requests_on_cpu(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family, mtp_num_hidden_layers=1)
    engine = {"device": "cpu", "max_num_tokens": 64, "tokens_per_block": 8}
    _check(ckpt, {**engine, "disable_overlap_scheduler": True}, engine)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_media_requests_on_cuda_match_the_graph_path(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family, mtp_num_hidden_layers=1)
    fast = {"device": "cuda", "dtype": "float32", "attn_backend": "triton"}
    # The reference: decode CUDA graphs and the overlap scheduler (the defaults).
    _check(ckpt, fast, fast)
