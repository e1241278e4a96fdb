"""trtllm-serve end to end: a real server (tiny demo checkpoint, CPU) and the real openai client.

Server outputs are compared with the LLM API called directly on the same engine, so a wrong
prompt (a lost image, a bad chat rendering) or a wrong usage count shows as a mismatch.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import httpx
from conftest import MAX_SEQ_LEN
from PIL import Image
from serve_helpers import (
    ServeHandle,
    data_url,
    gif_bytes,
    image_part,
    metric,
    png_bytes,
    user,
)

from tensorrt_llm.inputs.utils import VideoData
from tensorrt_llm.sampling_params import SamplingParams

MAX_TOKENS = 8


def _direct(served: ServeHandle, messages: list[dict[str, Any]], **kw: Any) -> Any:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", MAX_TOKENS), temperature=0.0, **kw)
    return served.llm.generate(messages, params)


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def _chat(served: ServeHandle, messages: list[dict[str, Any]], **kw: Any) -> Any:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return served.client().chat.completions.create(
        model=served.model, messages=messages, temperature=0, **kw
    )


def test_models_health_and_metrics(served: ServeHandle) -> None:
    models = served.client().models.list().data
    assert [m.id for m in models] == [served.model]
    assert httpx.get(served.base_url + "/health").status_code == 200
    samples = served.metrics()
    assert metric(samples, "trtllm_seq_slots_total") >= 1
    assert metric(samples, "trtllm_kv_cache_total_blocks") >= 1


def test_request_stage_times(served: ServeHandle) -> None:
    # Each stage before the first token is timed once per request, and together they fit in
    # the TTFT (measured from the same handler start).
    stages = ("parse", "media", "prepare", "first_token")

    def read(samples: dict[str, float], what: str) -> list[float]:
        name = "trtllm_request_stage_seconds_" + what
        return [metric(samples, name, stage=s) for s in stages]

    before = served.metrics()
    _chat(served, user(image_part(data_url(png_bytes())), "What is in the image?"))
    after = served.metrics()
    counts = [a - b for a, b in zip(read(after, "count"), read(before, "count"), strict=True)]
    assert counts == [1, 1, 1, 1]
    spent = [a - b for a, b in zip(read(after, "sum"), read(before, "sum"), strict=True)]
    assert all(t > 0 for t in spent), spent
    ttft = metric(after, "trtllm_time_to_first_token_seconds_sum") - metric(
        before, "trtllm_time_to_first_token_seconds_sum"
    )
    assert sum(spent) <= ttft + 1e-6
    # The engine's stages split first_token (plus the end of prepare, where the engine request
    # is built), recorded once the request finished.
    engine = ("engine_queue", "engine_prefill")
    name = "trtllm_request_stage_seconds_"
    done = [metric(after, name + "count", stage=s) - metric(before, name + "count", stage=s)
            for s in engine]  # fmt: skip
    assert done == [1, 1]
    took = [metric(after, name + "sum", stage=s) - metric(before, name + "sum", stage=s)
            for s in engine]  # fmt: skip
    assert all(t >= 0 for t in took) and took[1] > 0
    assert sum(took) <= spent[2] + spent[3] + 1e-6


def test_chat_one_image_matches_llm_api(served: ServeHandle) -> None:
    png = png_bytes()
    response = _chat(served, user(image_part(data_url(png)), "What is in the image?"))
    ref = _direct(served, user({"type": "image", "image": _pil(png)}, "What is in the image?"))
    choice = response.choices[0]
    assert choice.message.content == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    # NOTE: prompt_tokens is the expanded prompt: the image's vision tokens are counted.
    assert response.usage.prompt_tokens == len(ref.prompt_token_ids)
    text_only = _direct(served, user("What is in the image?"))
    assert response.usage.prompt_tokens > len(text_only.prompt_token_ids) + 2
    assert response.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert response.usage.total_tokens == response.usage.prompt_tokens + len(
        ref.outputs[0].token_ids
    )


def test_chat_two_images_and_text_only(served: ServeHandle) -> None:
    a, b = png_bytes(color=(10, 200, 10)), png_bytes(size=(80, 40), color=(10, 10, 200))
    two = _chat(served, user(image_part(data_url(a)), "and", image_part(data_url(b)), "compare"))
    ref = _direct(
        served,
        user(
            {"type": "image", "image": _pil(a)},
            "and",
            {"type": "image", "image": _pil(b)},
            "compare",
        ),
    )
    assert two.choices[0].message.content == ref.outputs[0].text
    assert two.usage.prompt_tokens == len(ref.prompt_token_ids)

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    text = _chat(served, messages)
    ref_text = _direct(served, messages)
    assert text.choices[0].message.content == ref_text.outputs[0].text
    assert text.usage.prompt_tokens == len(ref_text.prompt_token_ids)
    assert text.usage.prompt_tokens < two.usage.prompt_tokens


def test_local_file_and_video(served: ServeHandle, media_root: Path) -> None:
    local = _chat(served, user(image_part((media_root / "red.png").as_uri()), "describe"))
    ref = _direct(
        served,
        user({"type": "image", "image": _pil((media_root / "red.png").read_bytes())}, "describe"),
    )
    assert local.choices[0].message.content == ref.outputs[0].text

    gif = gif_bytes()
    video = _chat(
        served, user({"type": "video_url", "video_url": {"url": data_url(gif, "image/gif")}}, "hi")
    )
    frames = [frame.convert("RGB") for frame in _gif_frames(gif)]
    ref_video = _direct(served, user({"type": "video", "video": VideoData(frames, fps=2.0)}, "hi"))
    assert video.choices[0].message.content == ref_video.outputs[0].text
    assert video.usage.prompt_tokens == len(ref_video.prompt_token_ids)

    folder = _chat(
        served,
        user({"type": "video_url", "video_url": {"url": str(media_root / "clip"), "fps": 2}}),
    )
    assert folder.usage.prompt_tokens > 10


def _gif_frames(data: bytes) -> list[Image.Image]:
    from PIL import ImageSequence

    return [f.copy() for f in ImageSequence.Iterator(Image.open(io.BytesIO(data)))]


def test_streaming_reassembles_to_non_streamed(served: ServeHandle) -> None:
    messages = user(image_part(data_url(png_bytes())), "Tell me a story.")
    whole = _chat(served, messages, max_tokens=16)
    stream = served.client().chat.completions.create(
        model=served.model,
        messages=messages,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])

    no_usage = served.client().chat.completions.create(
        model=served.model, messages=messages, temperature=0, max_tokens=4, stream=True
    )
    assert all(c.usage is None and c.choices for c in no_usage)


def test_completions_n_seed_and_stop(served: ServeHandle) -> None:
    client = served.client()
    greedy = client.completions.create(
        model=served.model, prompt=["Once upon", "a time"], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    # Greedy: both completions of one prompt agree; the prompts differ.
    assert greedy.choices[0].text == greedy.choices[1].text
    ref = served.llm.generate("Once upon", SamplingParams(max_tokens=6, temperature=0.0))
    ref2 = served.llm.generate("a time", SamplingParams(max_tokens=6, temperature=0.0))
    assert greedy.choices[0].text == ref.outputs[0].text
    assert greedy.choices[2].text == ref2.outputs[0].text
    assert greedy.usage.prompt_tokens == len(ref.prompt_token_ids) + len(ref2.prompt_token_ids)
    assert greedy.usage.completion_tokens == 2 * (
        len(ref.outputs[0].token_ids) + len(ref2.outputs[0].token_ids)
    )

    ids = client.completions.create(
        model=served.model, prompt=ref.prompt_token_ids, max_tokens=6, temperature=0
    )
    assert ids.choices[0].text == ref.outputs[0].text

    sampled = [
        client.completions.create(
            model=served.model, prompt="Once upon", max_tokens=8, temperature=1.0, seed=7
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert sampled[0] == sampled[1]  # a seed makes sampling reproducible

    text = ref.outputs[0].text
    # A stop string that first occurs mid-text: the output is cut just before it.
    cut = next(
        i
        for i in range(1, len(text))
        if text[i].strip() and text[i] != "\ufffd" and text.find(text[i]) == i
    )
    stopped = client.completions.create(
        model=served.model, prompt="Once upon", max_tokens=6, temperature=0, stop=[text[cut]]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:cut]


def test_default_max_tokens_fits_context(served: ServeHandle) -> None:
    # No max_tokens and a long prompt: the default is cut to what max_seq_len leaves.
    piece = " hello"
    per_piece = len(served.llm.tokenizer.encode(piece * 10)) / 10
    prompt = piece * int((MAX_SEQ_LEN - 100) / per_piece)
    response = served.client().completions.create(model=served.model, prompt=prompt, temperature=0)
    assert response.usage.total_tokens <= MAX_SEQ_LEN
    assert response.choices[0].finish_reason in ("stop", "length")


def test_chat_template_kwargs_reach_the_engine(served: ServeHandle) -> None:
    # The demo template reads no variables: one it would never read is a 400 naming it, not a
    # request that runs as if the variable were not there (a typo of enable_thinking).
    messages = user("Hello")
    unread = httpx.post(
        served.base_url + "/v1/chat/completions",
        json={"model": served.model, "messages": messages, "chat_template_kwargs": {"x": 1}},
        timeout=30,
    )
    assert unread.status_code == 400
    assert (
        "chat_template_kwargs ['x']: this model's chat template does not read them"
        in (unread.json()["error"]["message"])
    )
    bad = httpx.post(
        served.base_url + "/v1/chat/completions",
        json={"model": served.model, "messages": messages, "chat_template_kwargs": {"tokenize": 1}},
        timeout=30,
    )
    assert bad.status_code == 400 and "may not set" in bad.json()["error"]["message"]


def test_logit_bias_and_penalties_through_the_server(served: ServeHandle) -> None:
    token = 40
    response = _chat(served, user("Hello"), max_tokens=4, logit_bias={str(token): 100})
    want = served.llm.tokenizer.decode([token] * 4)
    assert response.choices[0].message.content == want
    # presence_penalty and min_tokens are accepted and change nothing fatal on the demo model
    ok = _chat(
        served, user("Hello"), max_tokens=3, presence_penalty=1.5, extra_body={"min_tokens": 3}
    )
    assert ok.usage.completion_tokens == 3
    bad = httpx.post(
        served.base_url + "/v1/chat/completions",
        json={"model": served.model, "messages": user("x"), "logit_bias": {"999999999": 1}},
        timeout=30,
    )
    assert bad.status_code == 400 and "logit_bias" in bad.text


def test_structured_output_through_the_server(served: ServeHandle) -> None:
    import jsonschema

    schema = {
        "type": "object",
        "properties": {
            "answer": {"enum": ["yes", "no"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["answer", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
    response = _chat(served, user("Answer in JSON"), max_tokens=64, response_format=fmt)
    assert response.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(response.choices[0].message.content), schema)
    picked = _chat(
        served, user("Pick"), max_tokens=16, extra_body={"guided_choice": ["red", "blue"]}
    )
    assert picked.choices[0].message.content in ("red", "blue")


def test_required_tool_choice_gives_a_valid_call_from_the_random_model(served: ServeHandle) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "pick",
                "parameters": {
                    "type": "object",
                    "properties": {"color": {"enum": ["red", "blue"]}},
                    "required": ["color"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    response = _chat(  # one call (parallel_tool_calls=false): the array closes after it
        served, user("Pick a color"), max_tokens=64, tools=tools, tool_choice="required",
        parallel_tool_calls=False,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "blue")


def test_priority_extra_body_on_both_endpoints(served: ServeHandle) -> None:
    """vLLM's `priority` (lower runs first) is accepted by both endpoints and changes no text."""
    client = served.client()
    ref = served.llm.generate("Once upon", SamplingParams(max_tokens=5, temperature=0.0))
    done = client.completions.create(
        model=served.model,
        prompt="Once upon",
        max_tokens=5,
        temperature=0,
        extra_body={"priority": -5},
    )
    assert done.choices[0].text == ref.outputs[0].text
    chat = _chat(served, user("Hello"), max_tokens=3, extra_body={"priority": 7})
    assert chat.usage.completion_tokens == 3
    bad = httpx.post(
        served.base_url + "/v1/completions",
        json={"model": served.model, "prompt": "x", "priority": "high"},
        timeout=30,
    )
    assert bad.status_code == 400 and "priority" in bad.text
