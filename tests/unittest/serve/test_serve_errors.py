"""Bad input gets HTTP 400 with an OpenAI-style body saying what was wrong; the server keeps
serving. Also: client disconnects free the request's seq slot and KV blocks, and shutdown
lets in-flight streams finish."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import IMAGE_LIMIT, MAX_SEQ_LEN
from serve_helpers import (
    ServeHandle,
    data_url,
    image_part,
    metric,
    png_bytes,
    start_server,
    user,
    wait_until_idle,
)

GOOD_IMAGE = data_url(png_bytes())


def _body(served: ServeHandle, messages: Any, **extra: Any) -> dict[str, Any]:
    return {"model": served.model, "messages": messages, "max_tokens": 4, **extra}


# (case id, body builder, expected code, message fragment)
BAD_BODIES = [
    ("missing messages", lambda s: {"model": s.model}, "invalid_request", "messages"),
    (
        "bad temperature",
        lambda s: _body(s, user("hi"), temperature=7),
        "invalid_request",
        "temperature",
    ),
    (
        "unknown part type",
        lambda s: _body(s, [{"role": "user", "content": [{"type": "audio"}]}]),
        "invalid_request",
        "content part type 'audio' is not supported",
    ),
    (
        "tools the template cannot render",
        lambda s: _body(s, user("hi"), tools=[{"type": "function", "function": {"name": "f"}}]),
        "invalid_prompt",
        "this model's chat template does not render tools, so the model would never see them",
    ),
    (
        "chat_template_kwargs the template never reads",
        lambda s: _body(s, user("hi"), chat_template_kwargs={"enable_thinkng": False}),
        "invalid_prompt",
        "chat_template_kwargs ['enable_thinkng']: this model's chat template does not read",
    ),
    (
        "tool call history the template drops",
        lambda s: _body(
            s,
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
        ),
        "invalid_prompt",
        "messages[1].tool_calls: this model's chat template does not render earlier tool calls",
    ),
    (
        "image detail medium",
        lambda s: _body(
            s, user({"type": "image_url", "image_url": {"url": GOOD_IMAGE, "detail": "medium"}})
        ),
        "invalid_request",
        "detail",
    ),
    (
        "input_audio part",
        lambda s: _body(
            s, [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]
        ),
        "invalid_request",
        "audio input is not supported by these models); this server takes text, image_url",
    ),
    (
        "not an image",
        lambda s: _body(s, user(image_part(data_url(b"not an image at all")))),
        "unsupported_media_type",
        "unsupported image format",
    ),
    (
        "truncated image",
        lambda s: _body(s, user(image_part(data_url(png_bytes()[:60])))),
        "corrupt_media",
        "corrupt or unreadable image",
    ),
    (
        "unsupported media type",
        lambda s: _body(s, user(image_part(data_url(b"%PDF-1.4", "application/pdf")))),
        "unsupported_media_type",
        "application/pdf",
    ),
    (
        "video container",
        lambda s: _body(
            s,
            user(
                {
                    "type": "video_url",
                    "video_url": {"url": data_url(b"\x00\x00\x00 ftyp", "video/mp4")},
                }
            ),
        ),
        "corrupt_media",
        "corrupt or unreadable video",
    ),
    (
        "too many images",
        lambda s: _body(s, user(*[image_part(GOOD_IMAGE)] * (IMAGE_LIMIT + 1))),
        "mm_limit_exceeded",
        f"at most {IMAGE_LIMIT} image",
    ),
    (
        "prompt too long",
        lambda s: _body(s, user("hello " * MAX_SEQ_LEN)),
        "prompt_too_long",
        f"max_seq_len={MAX_SEQ_LEN}",
    ),
    (
        "max_tokens too long",
        lambda s: {**_body(s, user("hi")), "max_tokens": MAX_SEQ_LEN},
        "prompt_too_long",
        "max_seq_len",
    ),
    (
        "unknown model",
        lambda s: {**_body(s, user("hi")), "model": "gpt-5"},
        "model_not_found",
        "'gpt-5' does not exist",
    ),
    (
        "path outside allowed",
        lambda s: _body(s, user(image_part("file:///etc/hostname"))),
        "local_path_not_allowed",
        "outside the allowed media folder",
    ),
    (
        "path traversal",
        lambda s: _body(s, user(image_part("file:///tmp/../etc/passwd"))),
        "local_path_not_allowed",
        "outside the allowed media folder",
    ),
    (
        "unknown scheme",
        lambda s: _body(s, user(image_part("ftp://example.com/a.png"))),
        "invalid_media_url",
        "'ftp'",
    ),
    (
        "top_logprobs without logprobs",
        lambda s: _body(s, user("hi"), top_logprobs=2),
        "invalid_request",
        "top_logprobs needs logprobs set to true",
    ),
    (
        "stream_options without stream",
        lambda s: _body(s, user("hi"), stream_options={"include_usage": True}),
        "invalid_request",
        "stream_options is only allowed when stream is true",
    ),
    (
        "logit_bias key",
        lambda s: _body(s, user("hi"), logit_bias={"abc": 1.0}),
        "invalid_request",
        "logit_bias keys must be token ids",
    ),
    (
        "logit_bias past the vocab",
        lambda s: _body(s, user("hi"), logit_bias={"99999999": 1.0}),
        "invalid_sampling_params",
        "logit_bias names token ids [99999999] outside the vocab",
    ),
    (
        "stop_token_ids past the vocab",
        lambda s: _body(s, user("hi"), stop_token_ids=[99999999]),
        "invalid_sampling_params",
        "stop_token_ids names token ids [99999999] outside the vocab",
    ),
    (
        "invalid json schema",
        lambda s: _body(s, user("hi"), guided_json="{not json"),
        "invalid_request",
        "guided_json",
    ),
    (
        "unknown field",
        lambda s: _body(s, user("hi"), temprature=0.1),
        "unsupported_field",
        "temprature",
    ),
]


@pytest.mark.parametrize(
    "builder,code,fragment", [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
def test_bad_input_gets_400_and_server_keeps_serving(
    served: ServeHandle, builder: Any, code: str, fragment: str
) -> None:
    response = httpx.post(
        served.base_url + "/v1/chat/completions", json=builder(served), timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code
    assert fragment in error["message"]
    assert error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}
    ok = served.client().chat.completions.create(
        model=served.model, messages=user("hi"), max_tokens=2, temperature=0
    )
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_invalid_json_and_openai_client_errors(served: ServeHandle, media_root: Path) -> None:
    for raw in (b"{not json", b"[1, 2]", b'{"model": NaN}', b"\xff\xfe"):
        response = httpx.post(served.base_url + "/v1/completions", content=raw)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"
    outside = media_root.parent / "secret.png"
    outside.write_bytes(png_bytes())
    link = media_root / "escape.png"
    if not link.exists():
        os.symlink(outside, link)
    # The openai client raises BadRequestError carrying the error body.
    with pytest.raises(openai.BadRequestError) as info:
        served.client().chat.completions.create(
            model=served.model, messages=user(image_part(link.as_uri())), max_tokens=2
        )
    assert info.value.body["code"] == "local_path_not_allowed"
    assert info.value.body["param"] == "messages.0.content.0.image_url"


def test_unknown_route_is_openai_style_404(served: ServeHandle) -> None:
    response = httpx.get(served.base_url + "/v1/nope")
    assert response.status_code == 404
    assert "message" in response.json()["error"]
    # vLLM routes a client may try: the 404 says what this server does serve.
    error = httpx.post(served.base_url + "/v1/embeddings", json={}).json()["error"]
    assert error["message"].startswith("no route POST /v1/embeddings; this server serves ")
    assert "POST /v1/chat/completions" in error["message"] and error["code"] == "not_found"
    assert "GET /v1/models/{model_id}" in error["message"]


def test_wrong_method_is_405_naming_the_allowed_one(served: ServeHandle) -> None:
    response = httpx.get(served.base_url + "/v1/chat/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    error = response.json()["error"]
    assert error["code"] == "method_not_allowed"
    assert error["message"] == "method GET is not allowed on /v1/chat/completions; use POST"


def _wait_cancelled(served: ServeHandle, before: float) -> dict[str, float]:
    samples = wait_until_idle(served)
    assert metric(samples, "trtllm_executor_requests_cancelled_total") > before
    assert metric(samples, "trtllm_seq_slots_free") == metric(samples, "trtllm_seq_slots_total")
    assert metric(samples, "trtllm_kv_cache_usage_ratio") == 0
    return samples


def test_disconnect_mid_stream_frees_slot_and_blocks(served: ServeHandle) -> None:
    before = metric(served.metrics(), "trtllm_executor_requests_cancelled_total")
    stream = served.client().chat.completions.create(
        model=served.model,
        messages=user("Tell me everything."),
        max_tokens=MAX_SEQ_LEN - 64,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    running = served.metrics()
    assert metric(running, "trtllm_seq_slots_free") < metric(running, "trtllm_seq_slots_total")
    stream.close()
    _wait_cancelled(served, before)


def test_disconnect_while_waiting_non_streamed(
    served: ServeHandle, caplog: pytest.LogCaptureFixture
) -> None:
    before = metric(served.metrics(), "trtllm_executor_requests_cancelled_total")
    body = _body(served, user("Tell me everything."), ignore_eos=True)
    body["max_tokens"] = MAX_SEQ_LEN - 64
    with caplog.at_level(logging.ERROR):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=0.3)
        _wait_cancelled(served, before)
        gc.collect()  # an abandoned future logs "never retrieved" when it is collected
    assert not [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]


def test_shutdown_finishes_in_flight_stream() -> None:
    handle = start_server(["--demo", "--device", "cpu", "--max_seq_len", "256"], graceful_s=20)
    events: list[str] = []
    started = threading.Event()

    def consume() -> None:
        stream = handle.client().completions.create(
            model=handle.model,
            prompt="Once",
            max_tokens=120,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            started.set()
            events.append(chunk.choices[0].finish_reason or "")

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(30)
    handle.server.should_exit = True
    reader.join(30)
    handle.thread.join(30)
    assert not handle.thread.is_alive()
    assert events[-1] == "length"  # the in-flight request ran to its end
    assert handle.llm._executor is None  # the lifespan shut the engine down
    with pytest.raises(httpx.ConnectError):
        httpx.get(handle.base_url + "/health", timeout=2)


def test_forced_shutdown_fails_streams_cleanly() -> None:
    handle = start_server(["--demo", "--device", "cpu", "--max_seq_len", "512"], graceful_s=0.2)
    errors: list[BaseException] = []
    started = threading.Event()

    def consume() -> None:
        try:
            stream = handle.client().completions.create(
                model=handle.model,
                prompt="Once",
                max_tokens=480,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
                time.sleep(0.01)  # a slow reader: the stream cannot finish in time
        except BaseException as exc:  # noqa: BLE001 - the failure itself is the result
            errors.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    assert started.wait(30)
    start = time.monotonic()
    handle.server.should_exit = True
    handle.thread.join(30)
    reader.join(30)
    assert not handle.thread.is_alive() and not reader.is_alive()
    assert time.monotonic() - start < 10
    assert errors, "the cut stream must fail on the client, not look complete"
