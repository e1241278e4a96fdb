"""Load: 64 concurrent clients x 4 requests against the real server, within a bounded time.

Every request must complete (the clients never retry, so any 5xx or dropped connection fails
the test), greedy outputs must equal those of solo runs (batching must not change results),
and afterwards /metrics must show every seq slot and KV block free again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from serve_helpers import (
    ServeHandle,
    data_url,
    image_part,
    metric,
    png_bytes,
    user,
    wait_until_idle,
)

NUM_CLIENTS = 64
REQUESTS_PER_CLIENT = 4
MAX_TOKENS = 6
TIME_BOUND_S = 90.0


def _prompts() -> list[list[dict[str, Any]]]:
    images = [data_url(png_bytes(size=(48 + 8 * i, 40), color=(30 * i, 90, 200))) for i in range(3)]
    prompts = [user(f"Question number {i}: what next?") for i in range(5)]
    prompts += [user(image_part(url), f"Describe picture {i}.") for i, url in enumerate(images)]
    return prompts


async def _ask(client: Any, model: str, messages: Any, stream: bool) -> tuple[str, int]:
    if not stream:
        r = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        return r.choices[0].message.content, r.usage.completion_tokens
    chunks = await client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None
    return text, usage.completion_tokens


async def _run_load(served: ServeHandle, prompts: list[Any]) -> list[tuple[int, str, int]]:
    client = served.async_client(timeout=60)
    results: list[tuple[int, str, int]] = []

    async def one_client(c: int) -> None:
        for r in range(REQUESTS_PER_CLIENT):
            k = (c + r) % len(prompts)
            text, tokens = await _ask(client, served.model, prompts[k], stream=(c + r) % 2 == 1)
            results.append((k, text, tokens))

    try:
        await asyncio.gather(*(one_client(c) for c in range(NUM_CLIENTS)))
    finally:
        await client.close()
    return results


def test_concurrent_clients_match_solo_and_free_everything(served: ServeHandle) -> None:
    prompts = _prompts()
    client = served.client()
    solo = []
    for messages in prompts:
        r = client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
        )
        solo.append((r.choices[0].message.content, r.usage.completion_tokens))
    before = served.metrics()

    start = time.monotonic()
    results = asyncio.run(_run_load(served, prompts))
    elapsed = time.monotonic() - start

    assert len(results) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    assert elapsed < TIME_BOUND_S, f"load took {elapsed:.1f} s"
    mismatches = [(k, text, solo[k][0]) for k, text, _ in results if text != solo[k][0]]
    assert not mismatches, f"{len(mismatches)} outputs differ from solo runs: {mismatches[:3]}"
    assert all(tokens == solo[k][1] for k, _, tokens in results)

    after = wait_until_idle(served)
    assert metric(after, "trtllm_seq_slots_free") == metric(after, "trtllm_seq_slots_total")
    assert metric(after, "trtllm_kv_cache_free_blocks") == metric(
        after, "trtllm_kv_cache_total_blocks"
    )
    assert metric(after, "trtllm_kv_cache_usage_ratio") == 0
    served_ok = metric(
        after, "trtllm_http_requests_total", endpoint="/v1/chat/completions", status="200"
    ) - metric(before, "trtllm_http_requests_total", endpoint="/v1/chat/completions", status="200")
    assert served_ok == NUM_CLIENTS * REQUESTS_PER_CLIENT
    five_xx = [
        k
        for k, v in after.items()
        if k.startswith("trtllm_http_requests_total") and 'status="5' in k and v > 0
    ]
    assert not five_xx, five_xx
    ttft = metric(after, "trtllm_time_to_first_token_seconds_count") - metric(
        before, "trtllm_time_to_first_token_seconds_count"
    )
    assert ttft == NUM_CLIENTS * REQUESTS_PER_CLIENT


SAMPLED_TOKENS = 12


async def _ask_sampled(client: Any, model: str, messages: Any, seed: int, stream: bool) -> int:
    """A hot (temperature 2) seeded request that runs its full length; its completion tokens."""
    kwargs = dict(
        model=model,
        messages=messages,
        max_tokens=SAMPLED_TOKENS,
        temperature=2.0,
        seed=seed,
        extra_body={"ignore_eos": True},
    )
    if not stream:
        r = await client.chat.completions.create(**kwargs)
        assert r.choices[0].finish_reason == "length"
        return r.usage.completion_tokens
    chunks = await client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    )
    usage, reasons = None, []
    async for chunk in chunks:
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        usage = chunk.usage or usage
    assert reasons == ["length"] and usage is not None
    return usage.completion_tokens


def test_hot_sampling_mixed_with_images_loses_nothing(served: ServeHandle) -> None:
    """Sampled tokens at temperature 2 hit every id, the vision placeholders included, while
    other requests' image prefills share the steps: nothing may fail or leak."""
    prompts = _prompts()
    before = served.metrics()

    async def run() -> list[int]:
        client = served.async_client(timeout=120)
        tokens: list[int] = []

        async def one_client(c: int) -> None:
            for r in range(REQUESTS_PER_CLIENT):
                k = (c * REQUESTS_PER_CLIENT + r) % len(prompts)
                if (c + r) % 2:
                    tokens.append(
                        await _ask_sampled(client, served.model, prompts[k], 1000 * c + r, c % 2)
                    )
                else:
                    tokens.append((await _ask(client, served.model, prompts[k], c % 2 == 1))[1])

        try:
            await asyncio.gather(*(one_client(c) for c in range(NUM_CLIENTS)))
        finally:
            await client.close()
        return tokens

    tokens = asyncio.run(run())
    assert len(tokens) == NUM_CLIENTS * REQUESTS_PER_CLIENT
    assert tokens.count(SAMPLED_TOKENS) >= NUM_CLIENTS * REQUESTS_PER_CLIENT // 2
    after = wait_until_idle(served)
    assert metric(after, "trtllm_seq_slots_free") == metric(after, "trtllm_seq_slots_total")
    assert metric(after, "trtllm_kv_cache_free_blocks") == metric(
        after, "trtllm_kv_cache_total_blocks"
    )
    ok = metric(
        after, "trtllm_http_requests_total", endpoint="/v1/chat/completions", status="200"
    ) - metric(before, "trtllm_http_requests_total", endpoint="/v1/chat/completions", status="200")
    assert ok == NUM_CLIENTS * REQUESTS_PER_CLIENT
    five_xx = [k for k, v in after.items() if "http_requests_total" in k and 'status="5' in k]
    assert not five_xx, five_xx
