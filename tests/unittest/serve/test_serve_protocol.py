"""Request models, SamplingParams conversion, metrics rendering and the CLI parser (no server)."""

from __future__ import annotations

import argparse
import math

import pytest
from pydantic import ValidationError

from tensorrt_llm.commands.serve import llm_kwargs, parse_args, parse_mm_limits
from tensorrt_llm.serve.chat_utils import check_mm_limits, count_media, to_sampling_params
from tensorrt_llm.serve.metrics import Histogram, ServerMetrics, parse_prometheus
from tensorrt_llm.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error_message,
)


def _chat(**kw: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate(body)


def test_validation_message_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        _chat(temperature=9, n=0)
    message, param = validation_error_message(info.value)
    assert param == "temperature"
    assert "temperature" in message and "n:" in message and "less than or equal to 2" in message


@pytest.mark.parametrize(
    "content,param,fragment",
    [
        ([{"type": "text"}], "messages.0.content.0.text", "Field required"),
        ([{"type": "text", "text": "a", "x": 1}], "messages.0.content.0.x", "Extra inputs"),
        (
            [{"type": "image_url", "image_url": {"url": 1}}],
            "messages.0.content.0.image_url.url",
            "valid string",
        ),
        ([{"type": "input_audio"}], "messages.0", "content part type 'input_audio'"),
    ],
)
def test_validation_message_of_a_bad_part_names_its_path(
    content: list, param: str, fragment: str
) -> None:
    # Not the union's members ("content.str", "list[tagged-union[...]]") nor the tag.
    with pytest.raises(ValidationError) as info:
        _chat(messages=[{"role": "user", "content": content}])
    message, got = validation_error_message(info.value)
    assert got == param and fragment in message
    assert "union" not in message and "content.str" not in message and "Value error" not in message


@pytest.mark.parametrize(
    "bad",
    [
        {"messages": []},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"stop": ["a", "b", "c", "d", "e"]},
        {"stop": [""]},
        {"top_p": 0},
        {"seed": -1},
        {"seed": 2**64},
        {"max_tokens": 0},
        {"stream_options": {"include_usage": "maybe"}},
    ],
)
def test_schema_rejects(bad: dict) -> None:
    with pytest.raises(ValidationError):
        _chat(**bad)


def test_parts_and_media_counting() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:x"}}
    req = _chat(
        messages=[
            {"role": "system", "content": "s"},
            {
                "role": "user",
                "content": [
                    image,
                    {"type": "image_url", "image_url": "u"},
                    {"type": "video_url", "video_url": {"url": "v", "fps": 2}},
                ],
            },
        ]
    )
    assert count_media(req.messages) == {"image": 2, "video": 1}
    check_mm_limits(req.messages, {"image": 2})
    with pytest.raises(APIError) as info:
        check_mm_limits(req.messages, {"image": 1})
    assert info.value.status == 400 and info.value.code == "mm_limit_exceeded"
    assert "2 image(s)" in info.value.message and "at most 1" in info.value.message


def test_sampling_params_conversion() -> None:
    req = _chat(
        temperature=0,
        top_p=0.5,
        top_k=-1,
        seed=3,
        stop="##",
        n=2,
        max_completion_tokens=7,
        max_tokens=99,
    )
    assert req.effective_max_tokens == 7  # the newer name wins
    sp = to_sampling_params(req, req.effective_max_tokens)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.n, sp.max_tokens) == (
        0.0,
        0.5,
        0,
        3,
        2,
        7,
    )
    assert sp.stop_strings == ["##"] and sp.is_greedy and sp.priority == 0
    # vLLM's extra_body priority reaches the engine (lower runs first).
    assert to_sampling_params(_chat(priority=-3), 4).priority == -3
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "priority": 2})
    assert to_sampling_params(completion, 4).priority == 2


def test_completion_prompt_forms() -> None:
    def prompts(p: object) -> list:
        return CompletionRequest.model_validate({"model": "m", "prompt": p}).prompts()

    assert prompts("a") == ["a"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    for bad in ([], [[]], [-1], [1.5]):
        with pytest.raises(ValidationError):
            prompts(bad)
    echo = CompletionRequest.model_validate({"model": "m", "prompt": "a", "echo": True})
    assert echo.unsupported_features() is None and echo.sampled_prompt_logprobs is None
    with_lp = {"model": "m", "prompt": "a", "echo": True, "logprobs": 2}
    assert CompletionRequest.model_validate(with_lp).sampled_prompt_logprobs == 2
    both = {**with_lp, "prompt_logprobs": 5}
    assert CompletionRequest.model_validate(both).sampled_prompt_logprobs == 5
    with pytest.raises(ValidationError, match="stream"):
        CompletionRequest.model_validate({**both, "stream": True})


def test_histogram_is_cumulative_and_renders() -> None:
    hist = Histogram([0.1, 1.0])
    for value in (0.05, 0.1, 0.5, 3.0, math.inf):
        hist.observe(value)
    hist.observe(0.2, times=3)
    samples = parse_prometheus("\n".join(hist.render("x", {"m": "a"})))
    assert samples['x_bucket{m="a",le="0.1"}'] == 2  # le is inclusive
    assert samples['x_bucket{m="a",le="1"}'] == 6
    assert samples['x_bucket{m="a",le="+Inf"}'] == 7  # inf is ignored (not finite)
    assert samples['x_count{m="a"}'] == 7
    assert samples['x_sum{m="a"}'] == pytest.approx(0.05 + 0.1 + 0.5 + 3.0 + 0.6)


def test_server_metrics_render() -> None:
    stats = argparse.Namespace(
        num_running=2,
        num_waiting=1,
        kv_cache_usage=0.25,
        num_free_seq_slots=6,
        num_total_seq_slots=8,
        num_steps=10,
        num_preemptions=4,
    )
    metrics = ServerMetrics('m"x', lambda: stats)
    metrics.on_http("/v1/completions", 200)
    metrics.on_http("/v1/completions", 200)
    metrics.on_first_token(0.05)
    metrics.on_tokens(0.03, 3)
    metrics.on_request_done(["stop", "length"], prompt_tokens=10, gen_tokens=7, e2e_s=0.2)
    text = metrics.render()
    samples = parse_prometheus(text)
    label = 'model_name="m\\"x"'
    assert (
        samples[f'trtllm_http_requests_total{{{label},endpoint="/v1/completions",status="200"}}']
        == 2
    )
    assert samples[f"trtllm_num_requests_running{{{label}}}"] == 2
    assert samples[f"trtllm_kv_cache_usage_ratio{{{label}}}"] == 0.25
    assert samples[f"trtllm_seq_slots_free{{{label}}}"] == 6
    assert samples[f"trtllm_executor_preemptions_total{{{label}}}"] == 4
    assert samples[f"trtllm_prompt_tokens_total{{{label}}}"] == 10
    assert samples[f"trtllm_generation_tokens_total{{{label}}}"] == 7
    assert samples[f"trtllm_inter_token_latency_seconds_count{{{label}}}"] == 3
    assert samples[f'trtllm_request_success_total{{{label},finish_reason="stop"}}'] == 1
    assert "# TYPE trtllm_time_to_first_token_seconds histogram" in text
    assert "kv_cache_total_blocks" not in text  # the stats object has no such field
    assert "num_requests_running" not in ServerMetrics("m", lambda: None).render()


def test_cli_parsing(tmp_path: object) -> None:
    assert parse_mm_limits('{"image": 2}') == {"image": 2}
    assert parse_mm_limits("image=2, video=1") == {"image": 2, "video": 1}
    for bad in ("image", '{"audio": 1}', "image=-1", "[1]", "image=x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mm_limits(bad)
    args = parse_args(
        ["ckpt", "--max_seq_len", "128", "--limit_mm_per_prompt", "image=3", "--device", "cpu"]
        + ["--kv_cache_dtype", "fp8", "--quantization", "fp8"]
    )
    chunking = parse_args(["ckpt", "--no-enable_chunked_prefill", "--max_num_tokens", "64"])
    assert llm_kwargs(chunking) == {"enable_chunked_prefill": False, "max_num_tokens": 64}
    assert llm_kwargs(parse_args(["ckpt", "--no-enable_block_reuse"])) == {
        "enable_block_reuse": False
    }
    assert llm_kwargs(parse_args(["ckpt", "--enable_block_reuse"])) == {"enable_block_reuse": True}
    assert llm_kwargs(parse_args(["ckpt", "--stream_interval", "8"])) == {"stream_interval": 8}
    assert "enable_block_reuse" not in llm_kwargs(parse_args(["ckpt"]))
    assert llm_kwargs(parse_args(["ckpt", "--enable_chunked_prefill"])) == {
        "enable_chunked_prefill": True
    }
    assert llm_kwargs(args) == {
        "max_seq_len": 128,
        "limit_mm_per_prompt": {"image": 3},
        "device": "cpu",
        "kv_cache_dtype": "fp8",
        "quantization": "fp8",
    }
    for bad in ([], ["ckpt", "--demo"], ["--demo", "--allowed_local_media_path", "/no/such"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


@pytest.mark.parametrize("detail", [None, "auto", "high", "low"])
def test_image_detail_is_accepted_and_anything_else_refused(detail: str | None) -> None:
    # Full resolution for None / "auto" / "high"; "low" fits the image into 512 x 512 first.
    part = {"type": "image_url", "image_url": {"url": "data:x", "detail": detail}}
    assert _chat(messages=[{"role": "user", "content": [part]}]).messages[0].parts()
    part["image_url"]["detail"] = "medium"  # type: ignore[index]
    with pytest.raises(ValidationError, match="detail"):
        _chat(messages=[{"role": "user", "content": [part]}])


def test_null_fields_take_their_defaults() -> None:
    # OpenAI's spec: n, stream, echo are nullable; clients (not the python one) send null.
    chat = _chat(n=None, stream=None, skip_special_tokens=None, priority=None)
    assert (chat.n, chat.stream, chat.skip_special_tokens, chat.priority) == (1, False, True, 0)
    completion = CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "n": None, "echo": None, "stream": None}
    )
    assert (completion.n, completion.echo, completion.stream) == (1, False, False)
    with pytest.raises(ValidationError, match="model"):
        CompletionRequest.model_validate({"model": None, "prompt": "x"})


@pytest.mark.parametrize("prompt", [["a", [1, 2]], [1, "a"], {"x": 1}, 5, None, [True]])
def test_a_prompt_of_no_form_says_which_forms_exist(prompt: object) -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    message, param = validation_error_message(info.value)
    assert param == "prompt"
    assert message == (
        "invalid request: prompt: expected a string, a list of strings, a list of token ids, "
        "or a list of token-id lists (one form for the whole list)"
    )


def test_a_negative_token_id_is_named_without_the_union_noise() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "m", "prompt": [[1, -2]]})
    assert validation_error_message(info.value) == (
        "invalid request: prompt.0.1: Input should be greater than or equal to 0",
        "prompt.0.1",
    )
