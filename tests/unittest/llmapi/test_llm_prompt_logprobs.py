"""`SamplingParams.prompt_logprobs` end to end through `LLM` on tiny random checkpoints (CPU).

Every prompt position p >= 1 carries HF's log_softmax of the logits at p - 1 for prompt token
p (teacher-forced over the whole prompt), with its rank and the top k in order; position 0 is
None. Chunked prefill (several chunks per prompt) and LM-head slices of a few rows give the
same values; a batch mixing requests with and without prompt logprobs leaves the others
untouched; n > 1, process mode, and a multimodal prompt whose image placeholders get entries.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor import prompt_logprobs as engine_prompt_logprobs
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi import Logprob
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

KWARGS: dict[str, Any] = dict(
    device="cpu", max_batch_size=4, max_num_tokens=256, max_seq_len=256, tokens_per_block=16
)
PROMPTS = [
    "the quick brown fox jumps over the lazy dog, again and again",
    "a b c",
    "hello there, general kenobi",
]
ATOL = 2e-4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("prompt_logprobs"))


@pytest.fixture(scope="module")
def hf(ckpt: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def _hf_prompt_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """[L - 1, vocab]: row p - 1 is the distribution of prompt token p."""
    return torch.log_softmax(logits[:-1].float(), dim=-1)


def _check_entries(prompt_ids: list[int], got: list[Any], want: torch.Tensor, k: int) -> None:
    assert len(got) == len(prompt_ids) and got[0] is None
    for p in range(1, len(prompt_ids)):
        entry, row, tok = got[p], want[p - 1], prompt_ids[p]
        assert next(iter(entry)) == tok  # the prompt token comes first
        assert isinstance(entry[tok], Logprob)
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=ATOL)
        # Ranks count the strictly more likely tokens; values within ATOL may swap.
        surely_above = int((row > row[tok] + ATOL).sum())
        maybe_above = int((row > row[tok] - ATOL).sum()) - 1
        rank = entry[tok].rank
        assert rank is not None and surely_above + 1 <= rank <= maybe_above + 1
        ranked = sorted((t for t, v in entry.items() if v.rank <= k), key=lambda t: entry[t].rank)
        if k:
            top = row.topk(k)
            assert ranked == top.indices.tolist()
            got_values = [entry[t].logprob for t in ranked]
            assert got_values == pytest.approx(top.values.tolist(), abs=ATOL)
            assert [entry[t].rank for t in ranked] == list(range(1, k + 1))
        assert len(entry) in (k, k + 1)


def _hf_check(hf: Any, result: Any, k: int) -> None:
    ids = list(result.prompt_token_ids)
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([ids])).logits[0]
    _check_entries(ids, result.prompt_logprobs, _hf_prompt_logprobs(logits), k)
    for out in result.outputs:
        assert out.prompt_logprobs is result.prompt_logprobs


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3, logprobs=2),
        SamplingParams(max_tokens=4, temperature=0.0),  # asks for none
        SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0),
    ]


@pytest.mark.parametrize("overlap", [True, False])
def test_prompt_logprobs_match_hf_in_a_mixed_batch(ckpt: Path, hf: Any, overlap: bool) -> None:
    params = _params()
    with LLM(
        str(ckpt), executor_mode="inproc", disable_overlap_scheduler=not overlap, **KWARGS
    ) as llm:
        outputs = llm.generate(PROMPTS, params)
        plain = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0))
    _hf_check(hf, outputs[0], 3)
    _hf_check(hf, outputs[2], 0)
    assert outputs[1].prompt_logprobs is None and outputs[1].outputs[0].prompt_logprobs is None
    # Asking for prompt logprobs changes nothing else: same tokens as without.
    for mine, theirs in zip(outputs, plain, strict=True):
        assert mine.outputs[0].token_ids == theirs.outputs[0].token_ids
    assert len(outputs[0].outputs[0].logprobs) == 4


@pytest.mark.parametrize("overlap", [True, False])
def test_chunked_prefill_and_lm_head_slices_give_the_same_values(
    ckpt: Path, hf: Any, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 rows per LM-head slice (vocab of the tiny checkpoint x 4 bytes x 3).
    vocab = hf.config.vocab_size
    monkeypatch.setattr(engine_prompt_logprobs, "SLICE_BYTES", 4 * vocab * 3)
    chunked = dict(KWARGS, max_num_tokens=8, enable_chunked_prefill=True)
    params = _params()
    with LLM(
        str(ckpt), executor_mode="inproc", disable_overlap_scheduler=not overlap, **chunked
    ) as llm:
        outputs = llm.generate(PROMPTS, params)
    assert len(outputs[0].prompt_token_ids) > 2 * 8  # at least three chunks
    _hf_check(hf, outputs[0], 3)
    _hf_check(hf, outputs[2], 0)
    assert outputs[1].prompt_logprobs is None


def test_n_greater_than_one_and_process_mode(ckpt: Path, hf: Any) -> None:
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=3, n=2, prompt_logprobs=2)
    with LLM(str(ckpt), executor_mode="process", **KWARGS) as llm:
        result = llm.generate(PROMPTS[0], params)
        one_token = llm.generate({"prompt_token_ids": [17]}, SamplingParams(prompt_logprobs=1))
    assert len(result.outputs) == 2
    _hf_check(hf, result, 2)
    assert one_token.prompt_logprobs == [None]


def test_bad_prompt_logprobs_values() -> None:
    for value in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)


def _image(h: int, w: int) -> Image.Image:
    rng = np.random.default_rng(4)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _hf_vl_logits(hf: Any, ids: list[int], data: dict[str, Any]) -> torch.Tensor:
    kwargs: dict[str, Any] = {
        "input_ids": torch.tensor([ids]),
        "pixel_values": data["image"]["pixel_values"].float(),
        "image_grid_thw": data["image"]["image_grid_thw"],
    }
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
        # transformers >= 5.2x finds the vision blocks from token types.
        kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == hf.config.image_token_id).int()
    with torch.no_grad():
        return hf(**kwargs).logits[0]


def test_multimodal_prompt_image_positions_get_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = write_tiny_checkpoint("qwen2_vl", tmp_path)
    monkeypatch.setattr(engine_prompt_logprobs, "SLICE_BYTES", 4 * 1024 * 16)
    inputs = {
        "prompt": [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is shown?"}],
            }
        ],
        "multi_modal_data": {"image": [_image(56, 84)]},
    }
    ids, extra = create_input_processor(ckpt)(inputs, None)
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = _hf_prompt_logprobs(_hf_vl_logits(hf, list(ids), extra["multimodal_data"]))
    # Chunks of 8 tokens cut through the image placeholders.
    chunked = dict(KWARGS, max_num_tokens=8, enable_chunked_prefill=True)
    with LLM(str(ckpt), executor_mode="inproc", **chunked) as llm:
        result = llm.generate(inputs, SamplingParams(max_tokens=2, prompt_logprobs=2))
    assert list(result.prompt_token_ids) == list(ids)
    image_rows = [p for p, t in enumerate(ids) if t == hf.config.image_token_id]
    # Placeholders after position 0, split by a chunk boundary (a multiple of 8).
    assert image_rows[0] > 0 and image_rows[0] // 8 != image_rows[-1] // 8
    _check_entries(list(ids), result.prompt_logprobs, want, 2)


@pytest.mark.parametrize(
    "family,hf_class",
    [
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),  # DeltaNet layers: chunked state
        ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration"),  # MoE stack
    ],
)
def test_hybrid_and_moe_stacks_over_chunks(tmp_path: Path, family: str, hf_class: str) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path)
    chunked = dict(KWARGS, max_num_tokens=8, enable_chunked_prefill=True)
    with LLM(str(ckpt), executor_mode="inproc", **chunked) as llm:
        result = llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, prompt_logprobs=2))
    ids = list(result.prompt_token_ids)
    assert len(ids) > 2 * 8
    hf = getattr(transformers, hf_class).from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    )
    kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
    if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
        kwargs["mm_token_type_ids"] = torch.zeros(1, len(ids), dtype=torch.int32)
    with torch.no_grad():
        logits = hf.eval()(**kwargs).logits[0]
    _check_entries(ids, result.prompt_logprobs, _hf_prompt_logprobs(logits), 2)


@pytest.mark.gpu
def test_cuda_piecewise_graphs_match_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA a dense Qwen-VL model's prefill runs through the piecewise graphs (run_hidden;
    # text-only Qwen2 has none); float32 weights and HF on the CPU as the reference, within
    # the Triton kernels' TF32 rounding.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setitem(globals(), "ATOL", 2e-3)
    ckpt = write_tiny_checkpoint("qwen2_vl", tmp_path)
    cuda = dict(KWARGS, device="cuda", dtype="float32")
    with LLM(str(ckpt), executor_mode="inproc", **cuda) as llm:
        assert llm._executor.model_engine.piecewise_graph_runner is not None
        outputs = llm.generate(PROMPTS, _params())
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32)
    _hf_check(hf.eval(), outputs[0], 3)
    _hf_check(hf, outputs[2], 0)
