"""End to end: `tensorrt_llm.LLM` on the tiny Qwen2-VL demo checkpoint (CPU, fp32).

Greedy outputs are checked against an uncached HF transformers greedy loop on the same weights,
and every other input form (batch, chat messages, streaming) must reproduce them exactly.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import io
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from PIL import Image

from tensorrt_llm import LLM, RequestOutput, SamplingParams
from tensorrt_llm.llmapi import PromptTooLongError
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
QUESTION = "Describe the picture."


@pytest.fixture(scope="module")
def ckpt() -> Path:
    return get_or_build_demo_checkpoint("qwen2_vl")


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Any:
    with LLM(
        str(ckpt),
        max_batch_size=4,
        max_num_tokens=256,
        max_seq_len=256,
        kv_cache_max_tokens=2048,
        tokens_per_block=16,
        limit_mm_per_prompt={"image": 2},
    ) as engine:
        yield engine


@pytest.fixture(scope="module")
def image() -> Image.Image:
    gen = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (56, 84, 3), generator=gen, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def image_prompt(llm: Any, image: Image.Image, n: int = 1) -> dict[str, Any]:
    return {
        "prompt": llm.input_processor.default_multimodal_prompt(QUESTION, num_images=n),
        "multi_modal_data": {"image": [image] * n},
    }


@torch.inference_mode()
def hf_greedy(ckpt: Path, ids: list[int], mm: dict[str, Any], n: int) -> list[int]:
    """Uncached HF greedy decoding: a full forward per token (slow but unambiguous)."""
    hf = transformers.Qwen2VLForConditionalGeneration.from_pretrained(
        ckpt, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    cfg = hf.config
    ids = list(ids)
    out: list[int] = []
    for _ in range(n):
        kwargs: dict[str, Any] = {"input_ids": torch.tensor([ids])}
        if "image" in mm:
            kwargs["pixel_values"] = mm["image"]["pixel_values"].float()
            kwargs["image_grid_thw"] = mm["image"]["image_grid_thw"]
        if "mm_token_type_ids" in inspect.signature(hf.forward).parameters:
            kwargs["mm_token_type_ids"] = (kwargs["input_ids"] == cfg.image_token_id).int()
        token = int(hf(**kwargs).logits[0, -1].argmax())
        out.append(token)
        ids.append(token)
    return out


def test_text_prompt_matches_hf(llm: Any, ckpt: Path) -> None:
    prompt = "Hello world, tell me a story"
    out = llm.generate(prompt, GREEDY)
    assert isinstance(out, RequestOutput) and out.finished and out.error is None
    ids = llm.tokenizer(prompt)["input_ids"]
    assert (
        out.prompt == prompt and out.prompt_token_ids == ids and out.num_prompt_tokens == len(ids)
    )
    comp = out.outputs[0]
    assert comp.finish_reason == "length" and len(comp.token_ids) == MAX_TOKENS
    assert comp.token_ids == hf_greedy(ckpt, ids, {}, MAX_TOKENS)
    assert comp.text == llm.tokenizer.decode(comp.token_ids, skip_special_tokens=True)


def test_image_prompt_matches_hf(llm: Any, ckpt: Path, image: Image.Image) -> None:
    inputs = image_prompt(llm, image)
    out = llm.generate(inputs, GREEDY)
    ids, extra = llm.input_processor(inputs, None)
    assert out.prompt_token_ids == ids
    want = hf_greedy(ckpt, ids, extra["multimodal_data"], MAX_TOKENS)
    assert out.outputs[0].token_ids == want


def test_batch_and_chat_match_single_requests(llm: Any, image: Image.Image) -> None:
    chat = [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}],
        }
    ]
    inputs = [
        "a b c",
        image_prompt(llm, image),
        chat,
        "The quick brown fox",
        image_prompt(llm, image, 2),
    ]
    singles = [llm.generate(x, GREEDY).outputs[0].token_ids for x in inputs]
    batch = llm.generate(inputs, GREEDY, use_tqdm=False)
    assert isinstance(batch, list) and len(batch) == len(inputs)
    assert [o.outputs[0].token_ids for o in batch] == singles
    # A chat with the image inside it equals the rendered prompt with the image outside.
    assert singles[2] == singles[1]
    assert batch[2].prompt is None and batch[2].prompt_token_ids == batch[1].prompt_token_ids


def test_streaming_reassembles_to_greedy(llm: Any, image: Image.Image) -> None:
    inputs = image_prompt(llm, image)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = llm.generate(inputs, params)

    async def stream() -> tuple[str, list[int], int, RequestOutput]:
        handle = llm.generate_async(inputs, params, streaming=True)
        text, ids, updates = "", [], 0
        async for part in handle:
            text += part.outputs[0].text_diff
            ids += part.outputs[0].token_ids_diff
            updates += 1
        return text, ids, updates, await handle

    text, ids, updates, final = asyncio.run(stream())
    assert updates > 1  # really streamed, not one final blob
    assert ids == want.outputs[0].token_ids and text == want.outputs[0].text
    assert final.outputs[0].text == want.outputs[0].text and final.finished
    # The synchronous iterator and .result() agree too.
    handle = llm.generate_async(inputs, params, streaming=True)
    assert "".join(p.outputs[0].text_diff for p in handle) == want.outputs[0].text
    assert llm.generate_async("x y", params).result().outputs[0].token_ids == (
        llm.generate("x y", params).outputs[0].token_ids
    )


def test_stream_interval_streams_the_same_tokens_in_fewer_updates(ckpt: Path) -> None:
    """stream_interval=4 (the engine in its own process): the first token alone, then the
    tokens four at a time, the last update with the rest; the same tokens and text."""
    params = SamplingParams(max_tokens=11, temperature=0.0, ignore_eos=True)
    with LLM(str(ckpt), max_batch_size=2, max_seq_len=128, stream_interval=4) as llm:
        want = llm.generate("Once upon a time", params).outputs[0]

        async def stream() -> tuple[list[int], list[int]]:
            counts, ids = [], []
            async for part in llm.generate_async("Once upon a time", params, streaming=True):
                counts.append(len(part.outputs[0].token_ids))
                ids += part.outputs[0].token_ids_diff
            return counts, ids

        counts, ids = asyncio.run(stream())
    # An update may merge several responses (the consumer was late), never split one.
    assert counts[-1] == 11 and set(counts) <= {1, 5, 9, 11}, counts
    assert ids == want.token_ids
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(str(ckpt), stream_interval=0)


def test_stop_string_cuts_text(llm: Any) -> None:
    full = llm.generate("Once upon a time", SamplingParams(max_tokens=16, temperature=0.0))
    text = full.outputs[0].text
    cut = next((i for i in range(2, len(text) - 1) if "\ufffd" not in text[i : i + 2]), None)
    assert cut is not None, f"no clean 2-char window in {text!r}"
    stop = text[cut : cut + 2]
    out = llm.generate(
        "Once upon a time", SamplingParams(max_tokens=16, temperature=0.0, stop=stop)
    )
    comp = out.outputs[0]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    assert comp.text == text[: text.find(stop)]


def test_bad_inputs_fail_alone(llm: Any, image: Image.Image) -> None:
    corrupt = {**image_prompt(llm, image), "multi_modal_data": {"image": [b"not a png"]}}
    with pytest.raises(ValueError, match="unsupported image format"):
        llm.generate(corrupt, GREEDY)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    truncated = {**image_prompt(llm, image), "multi_modal_data": {"image": [buf.getvalue()[:60]]}}
    with pytest.raises(ValueError, match="corrupt image"):
        llm.generate(truncated, GREEDY)
    # No placeholder at all: the chat template places it (issue 18); too few is an error.
    too_few = {
        "prompt": "<|vision_start|><|image_pad|><|vision_end|>" + QUESTION,
        "multi_modal_data": {"image": [image, image]},
    }
    with pytest.raises(ValueError, match="placeholder"):
        llm.generate(too_few, GREEDY)
    with pytest.raises(ValueError, match="limit_mm_per_prompt"):
        llm.generate(image_prompt(llm, image, 3), GREEDY)
    with pytest.raises(PromptTooLongError, match="max_seq_len"):  # a ValueError too
        llm.generate("word " * 300, GREEDY)
    with pytest.raises(ValueError, match="token ids") as bad_ids:
        llm.generate({"prompt_token_ids": [1, 10**6]}, GREEDY)
    assert not isinstance(bad_ids.value, PromptTooLongError)
    completed = llm.get_stats().num_completed
    with pytest.raises(ValueError, match="input 1"):
        llm.generate(["fine", corrupt, "also fine"], GREEDY)
    with pytest.raises(PromptTooLongError, match="input 1"):  # the type survives batching
        llm.generate(["fine", "word " * 300], GREEDY)
    assert llm.get_stats().num_completed == completed  # nothing of the batch was submitted
    out = llm.generate(image_prompt(llm, image), GREEDY)
    assert out.error is None and len(out.outputs[0].token_ids) == MAX_TOKENS


def test_sampling_n_seed_and_abort(llm: Any) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2)
    first = llm.generate("random", params)
    again = llm.generate("random", params)
    assert [o.index for o in first.outputs] == [0, 1]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    handle = llm.generate_async("abort me", SamplingParams(max_tokens=200, temperature=0.0))
    handle.abort()
    out = handle.result(timeout=30)
    assert out.outputs[0].finish_reason == "cancelled"
    assert len(out.outputs[0].token_ids) < 200


def test_png_bytes_image_is_accepted(llm: Any, image: Image.Image) -> None:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    a = llm.generate(
        {**image_prompt(llm, image), "multi_modal_data": {"image": [buf.getvalue()]}}, GREEDY
    )
    b = llm.generate(image_prompt(llm, image), GREEDY)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_quickstart_multimodal_demo_video(capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).parents[3] / "examples" / "llm-api" / "quickstart_multimodal.py"
    spec = importlib.util.spec_from_file_location("quickstart_multimodal", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    texts = module.main(["--modality", "video", "--max_tokens", "4", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert len(texts) == 1 and "Tell me what you see in the video briefly." in printed
    assert f"Generated text: {texts[0]!r}" in printed


def test_concurrent_async_requests_match_sync(llm: Any, image: Image.Image) -> None:
    inputs = ["one two", image_prompt(llm, image), "three four five"]
    want = [o.outputs[0].token_ids for o in llm.generate(inputs, GREEDY, use_tqdm=False)]

    async def run() -> list[RequestOutput]:
        return await asyncio.gather(*(llm.generate_async(x, GREEDY) for x in inputs))

    assert [o.outputs[0].token_ids for o in asyncio.run(run())] == want


def test_generation_config_end_ids_also_stop(llm: Any, ckpt: Path) -> None:
    import json

    eos = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    sp = llm._with_end_ids(SamplingParams())
    assert sp.end_id == llm.tokenizer.eos_token_id
    assert set(eos) <= {sp.end_id, *sp.stop_token_ids}
    explicit = llm._with_end_ids(SamplingParams(end_id=3))
    assert explicit.end_id == 3 and not explicit.stop_token_ids


def test_shutdown_fails_in_flight_and_rejects_new(ckpt: Path) -> None:
    with LLM(str(ckpt), max_batch_size=2, max_seq_len=256, kv_cache_max_tokens=1024) as other:
        handle = other.generate_async("keep going", SamplingParams(max_tokens=200, temperature=0))
    assert other.is_shutdown
    out = handle.result(timeout=30)
    # The shutdown command lands within a step, long before 200 tokens are generated.
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert "shut down" in (out.error or "")
    with pytest.raises(RuntimeError, match="shut down"):
        other.generate("hello", GREEDY)
    assert other.get_stats().num_running == 0
