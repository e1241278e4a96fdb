"""Bad input to `LLM.generate` raises ValueError/TypeError naming the field (issue 13, defect 8),
with no internal exception text, and the engine keeps serving; prompts too long by their byte
count alone are rejected before tokenizing (defect 4). Demo Qwen2-VL checkpoint, CPU.
"""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

GREEDY = SamplingParams(max_tokens=2, temperature=0.0)
# Texts that only an internal exception produces; none may reach the caller.
INTERNAL_TEXTS = (
    "math domain error",
    "to convert to C long",
    "object at 0x",
    "Traceback",
    "input processing failed",
    "could not convert",
    "invalid literal",
    "not supported between instances",
    "SizeDict",
)


@pytest.fixture(scope="module")
def llm() -> Any:
    ckpt: Path = get_or_build_demo_checkpoint("qwen2_vl")
    with LLM(
        str(ckpt),
        max_batch_size=2,
        max_num_tokens=256,
        max_seq_len=256,
        kv_cache_max_tokens=1024,
        tokens_per_block=16,
    ) as engine:
        yield engine


def _image_prompt(image: Any, **kwargs: Any) -> dict[str, Any]:
    return {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}
        ],
        "multi_modal_data": {"image": image},
        **({"mm_processor_kwargs": kwargs} if kwargs else {}),
    }


def _video_prompt(video: Any, **kwargs: Any) -> dict[str, Any]:
    return {
        "prompt": [
            {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}
        ],
        "multi_modal_data": {"video": video},
        "mm_processor_kwargs": {"fps": 2.0, **kwargs},
    }


def _image() -> torch.Tensor:
    return torch.rand(3, 56, 56, generator=torch.Generator().manual_seed(0))


def _video() -> torch.Tensor:
    return torch.rand(2, 3, 56, 56, generator=torch.Generator().manual_seed(1))


def _chat(*messages: Any) -> list[Any]:
    return list(messages)


# (case id, prompt, expected exception type, a word the message must contain)
CASES: list[tuple[str, Any, type[Exception], str]] = [
    ("nan_tensor", _image_prompt(torch.full((3, 56, 56), float("nan"))), ValueError, "image"),
    ("inf_array", _image_prompt(np.full((56, 56, 3), np.inf, np.float32)), ValueError, "image"),
    ("complex_tensor", _image_prompt(torch.zeros(3, 56, 56, dtype=torch.complex64)), ValueError,
     "image"),
    ("complex_array", _image_prompt(np.zeros((56, 56, 3), np.complex128)), ValueError, "image"),
    ("bool_array", _image_prompt(np.zeros((56, 56, 3), bool)), ValueError, "image"),
    ("object_array", _image_prompt(np.array([[object()]])), ValueError, "image"),
    ("bytesio_image", _image_prompt(io.BytesIO(b"xx")), ValueError, "image"),
    ("float_id", {"prompt_token_ids": [1.5]}, TypeError, "prompt_token_ids"),
    ("bool_id", {"prompt_token_ids": [True, 3]}, TypeError, "prompt_token_ids"),
    ("str_id", {"prompt_token_ids": ["7"]}, TypeError, "prompt_token_ids"),
    ("str_ids", {"prompt_token_ids": "123"}, TypeError, "prompt_token_ids"),
    ("nested_ids", {"prompt_token_ids": [[1, 2]]}, TypeError, "prompt_token_ids"),
    ("negative_id", {"prompt_token_ids": [-1]}, ValueError, "prompt_token_ids"),
    ("huge_id", {"prompt_token_ids": [10**30]}, ValueError, "prompt_token_ids"),
    ("enormous_id", {"prompt_token_ids": [10**5000]}, ValueError, "prompt_token_ids"),
    ("float_tensor_ids", {"prompt_token_ids": torch.tensor([1.0, 2.0])}, TypeError,
     "prompt_token_ids"),
    ("role_wizard", _chat({"role": "wizard", "content": "hi"}), ValueError, "role"),
    ("role_int", _chat({"role": 3, "content": "hi"}), TypeError, "role"),
    ("no_content", _chat({"role": "user"}), ValueError, "content"),
    ("content_int", _chat({"role": "user", "content": 5}), TypeError, "content"),
    ("text_part_int", _chat({"role": "user", "content": [{"type": "text", "text": 5}]}),
     TypeError, "text"),
    ("part_type", _chat({"role": "user", "content": [{"type": "audio"}]}), ValueError, "type"),
    ("prompt_int", {"prompt": 42}, TypeError, "prompt"),
    ("chat_and_ids", {"prompt": _chat({"role": "user", "content": "hi"}), "prompt_token_ids": [1]},
     ValueError, "not both"),
    ("typo_key", {"prompt": "hi", "multimodal_data": {}}, ValueError, "multimodal_data"),
    ("video_3d", _video_prompt(torch.rand(3, 56, 56)), ValueError, "video"),
    ("fps_negative", _video_prompt(_video(), fps=-1), ValueError, "fps"),
    ("fps_nan", _video_prompt(_video(), fps=float("nan")), ValueError, "fps"),
    ("fps_inf", _video_prompt(_video(), fps=float("inf"), do_sample_frames=True), ValueError,
     "fps"),
    ("fps_huge_int", _video_prompt(_video(), fps=10**400), ValueError, "fps"),
    ("fps_str", _video_prompt(_video(), fps="x"), TypeError, "fps"),
    ("num_frames_negative", _video_prompt(_video(), num_frames=-3), ValueError, "num_frames"),
    ("num_frames_float", _video_prompt(_video(), num_frames=1.5), TypeError, "num_frames"),
    ("num_frames_huge", _video_prompt(_video(), num_frames=10**30), ValueError, "num_frames"),
    ("do_sample_frames_str", _video_prompt(_video(), do_sample_frames="yes"), TypeError,
     "do_sample_frames"),
    ("min_pixels_negative", _image_prompt(_image(), min_pixels=-5), ValueError, "min_pixels"),
    ("min_pixels_zero", _image_prompt(_image(), min_pixels=0), ValueError, "min_pixels"),
    ("min_pixels_huge", _image_prompt(_image(), min_pixels=10**12), ValueError, "min_pixels"),
    ("max_pixels_negative", _image_prompt(_image(), max_pixels=-1), ValueError, "max_pixels"),
    ("max_pixels_huge", _image_prompt(_image(), max_pixels=10**30), ValueError, "max_pixels"),
    ("max_pixels_float", _image_prompt(_image(), max_pixels=1e5), TypeError, "max_pixels"),
    ("max_pixels_nan", _image_prompt(_image(), max_pixels=float("nan")), TypeError,
     "max_pixels"),
    ("max_pixels_str", _image_prompt(_image(), max_pixels="big"), TypeError, "max_pixels"),
    ("min_over_max", _image_prompt(_image(), min_pixels=9000, max_pixels=4000), ValueError,
     "min_pixels"),
    ("do_resize_str", _image_prompt(_image(), do_resize="no"), TypeError, "do_resize"),
    ("mm_kwargs_list", {"prompt": "hi", "mm_processor_kwargs": [1]}, TypeError,
     "mm_processor_kwargs"),
    ("unknown_mm_kwarg", _image_prompt(_image(), size=3), ValueError, "mm_processor_kwargs"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("prompt", "error", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_raises_naming_the_field(llm: Any, prompt: Any, error: type, field: str) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        llm.generate(prompt, GREEDY)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert field in message, message
    for text in INTERNAL_TEXTS:
        assert text not in message, message
    assert not re.search(r"0x[0-9a-fA-F]{6,}", message), message
    # The engine is untouched: a good request right after is served.
    out = llm.generate("hello", GREEDY)
    assert len(out.outputs[0].token_ids) == 2


def test_batch_keeps_error_type_and_index(llm: Any) -> None:
    with pytest.raises(TypeError, match=r"input 1: prompt_token_ids\[0\]"):
        llm.generate(["hello", {"prompt_token_ids": [1.5]}], GREEDY)


def test_unexpected_processor_failure_hides_its_text(llm: Any, monkeypatch: Any) -> None:
    def explode(*_: Any, **__: Any) -> Any:
        raise RuntimeError(f"secret internals {object()!r}")

    monkeypatch.setattr(type(llm.input_processor), "__call__", explode)
    with pytest.raises(ValueError) as info:
        llm.generate("hello", GREEDY)
    assert "secret" not in str(info.value) and "0x" not in str(info.value)
    assert "RuntimeError" in str(info.value)


# ------------------------------------------------------------------ too long by bytes alone


class _Spy:
    """Stands in for the input processor (and so the tokenizer): counts calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *_: Any, **__: Any) -> Any:
        self.calls += 1
        raise AssertionError("the prompt must be rejected before it is tokenized")


@pytest.mark.parametrize("form", ["text", "chat", "chat_parts"])
def test_huge_prompt_rejected_before_tokenizing(llm: Any, monkeypatch: Any, form: str) -> None:
    text = "a" * (10 * 1024 * 1024)
    prompt: Any = {
        "text": text,
        "chat": [{"role": "user", "content": text}],
        "chat_parts": [
            {"role": "system", "content": text[: len(text) // 2]},
            {"role": "user", "content": [{"type": "text", "text": text[: len(text) // 2]}]},
        ],
    }[form]
    spy = _Spy()
    monkeypatch.setattr(llm, "input_processor", spy)
    tokenizer_cls = type(llm.tokenizer)
    monkeypatch.setattr(tokenizer_cls, "__call__", spy)
    monkeypatch.setattr(tokenizer_cls, "encode", spy)
    start = time.perf_counter()
    with pytest.raises(PromptTooLongError, match="max_seq_len"):
        llm.generate(prompt, GREEDY)
    assert time.perf_counter() - start < 1.0
    assert spy.calls == 0


def test_byte_bound_never_rejects_a_prompt_that_fits(llm: Any) -> None:
    # The bound is an upper bound: the longest text that still tokenizes within max_seq_len
    # must pass the byte check (and then fail or pass on its real token count only).
    longest = max(len(t.encode()) for t in llm.tokenizer.get_vocab())
    token = max(llm.tokenizer.get_vocab(), key=lambda t: len(t.encode()))
    text = token * (llm.max_seq_len // 2)
    assert len(text.encode()) <= llm.max_seq_len * longest
    out = llm.generate(text, SamplingParams(max_tokens=1, temperature=0.0))
    assert len(out.outputs[0].token_ids) == 1
