"""Input preparation in worker processes (--num_preprocess_workers): the same answers and the
same errors as on the server's threads, and the loop-lag gauge."""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from PIL import Image
from serve_helpers import ServeHandle, data_url, image_part, metric, png_bytes, start_server, user

from tensorrt_llm.serve import media
from tensorrt_llm.serve.media_config import MediaError
from tensorrt_llm.serve.preprocess_pool import default_num_workers

IMAGE = data_url(png_bytes(size=(64, 40), color=(12, 140, 220)))


@pytest.fixture(scope="module")
def pooled(served: ServeHandle) -> Iterator[ServeHandle]:
    handle = start_server(["--demo", "--num_preprocess_workers", "2"], llm=served.llm)
    try:
        yield handle
    finally:
        handle.stop()


def _ask(handle: ServeHandle, messages: list, **extra: object) -> httpx.Response:
    body = {"model": handle.model, "messages": messages, "max_tokens": 6, "temperature": 0}
    body.update(extra)
    return httpx.post(handle.base_url + "/v1/chat/completions", json=body, timeout=120)


def test_pool_gives_the_same_answers(served: ServeHandle, pooled: ServeHandle) -> None:
    pool = pooled.server.config.app.state.server.pool
    assert pool is not None and pool.num_workers == 2
    calls = []
    prepare = pool.prepare

    async def counted(*args: object) -> object:
        calls.append(1)
        return await prepare(*args)

    pool.prepare = counted  # type: ignore[method-assign]
    try:
        for messages in (user("What is next?"), user(image_part(IMAGE), "Describe it.")):
            want = _ask(served, messages)
            got = _ask(pooled, messages)
            assert got.status_code == want.status_code == 200, got.text
            assert got.json()["choices"][0]["message"] == want.json()["choices"][0]["message"]
            assert got.json()["usage"] == want.json()["usage"]
    finally:
        pool.prepare = prepare  # type: ignore[method-assign]
    assert len(calls) == 2  # the pooled server prepared both in its workers


def test_pool_errors_are_the_same_400s(served: ServeHandle, pooled: ServeHandle) -> None:
    cases = [
        user("x" * 2000),  # longer than max_seq_len: prompt_too_long from the worker
        [{"role": "wizard", "content": "hi"}],
    ]
    for messages in cases:
        want, got = _ask(served, messages), _ask(pooled, messages)
        assert got.status_code == want.status_code == 400, (got.text, want.text)
        assert got.json()["error"]["code"] == want.json()["error"]["code"]
        assert got.json()["error"]["message"] == want.json()["error"]["message"]


def test_media_errors_from_the_workers_are_the_same_400s(
    served: ServeHandle, pooled: ServeHandle
) -> None:
    # Decoded in a worker, a bad image still names its code, field and reason.
    corrupt = "data:image/png;base64," + base64.b64encode(png_bytes()[:60]).decode()
    ico = io.BytesIO()
    Image.new("RGB", (8, 8)).save(ico, format="ICO")  # a format outside the allowlist
    unsupported = "data:image/png;base64," + base64.b64encode(ico.getvalue()).decode()
    for url in (corrupt, unsupported):
        messages = user("look", image_part(url))
        want, got = _ask(served, messages), _ask(pooled, messages)
        assert got.status_code == want.status_code == 400, (got.text, want.text)
        assert got.json()["error"] == want.json()["error"]


def test_the_server_process_decodes_no_media(pooled: ServeHandle, monkeypatch: Any) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("an image was decoded in the server process")

    monkeypatch.setattr(media, "_decode_image", refuse)
    got = _ask(pooled, user(image_part(IMAGE), "Describe it."))
    assert got.status_code == 200, got.text


def test_media_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(MediaError("bad", "messages.0.content.1", "corrupt_media")))
    assert (str(error), error.param, error.code) == ("bad", "messages.0.content.1", "corrupt_media")


def test_event_loop_lag_and_process_cpu_are_exported(pooled: ServeHandle) -> None:
    assert metric(pooled.metrics(), "trtllm_event_loop_lag_seconds") >= 0.0
    # Prometheus's standard process counter: this process's CPU so far, growing.
    first = metric(pooled.metrics(), "process_cpu_seconds_total")
    sum(i * i for i in range(300_000))  # some CPU in this process between the scrapes
    assert 0.0 < first < metric(pooled.metrics(), "process_cpu_seconds_total")


def test_default_pool_size(monkeypatch: Any) -> None:
    # CUDA: half the cores, at most 8, at least 1; CPU: none (the engine needs the cores).
    assert default_num_workers("cpu") == 0
    for cores, want in ((16, 8), (64, 8), (6, 3), (1, 1), (None, 1)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert default_num_workers("cuda") == want
