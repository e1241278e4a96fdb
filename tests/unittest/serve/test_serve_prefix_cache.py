"""Prefix caching through the server: a repeated chat reports its cached prompt tokens in
`usage.prompt_tokens_details.cached_tokens` (real openai client) and in /metrics."""

from __future__ import annotations

from serve_helpers import ServeHandle, metric, wait_until_idle

# The demo server runs with the default 32-token KV blocks.
TPB = 32


def _full(prompt_tokens: int) -> int:
    """A repeat's hit: every whole block but the one holding the last prompt token."""
    return (prompt_tokens - 1) // TPB * TPB


def test_repeated_chat_reports_cached_tokens(served: ServeHandle) -> None:
    client = served.client()
    # Unique words, so no other test of the session cached this conversation's tail.
    text = "prefix cache probe: " + " ".join(f"word{i}" for i in range(60))
    messages = [{"role": "user", "content": text}]
    before = served.metrics()
    first = client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=4, temperature=0.0
    )
    second = client.chat.completions.create(
        model=served.model, messages=messages, max_tokens=4, temperature=0.0
    )
    prompt = second.usage.prompt_tokens
    assert prompt == first.usage.prompt_tokens and prompt > 2 * TPB
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == _full(prompt)
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert second.choices[0].message.content == first.choices[0].message.content
    # Another tenant's salt shares nothing, not even the chat template's first blocks.
    salted = client.chat.completions.create(
        model=served.model,
        messages=messages,
        max_tokens=4,
        temperature=0.0,
        extra_body={"cache_salt": "tenant-b"},
    )
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert salted.choices[0].message.content == first.choices[0].message.content
    completion = client.completions.create(
        model=served.model, prompt=text, max_tokens=2, extra_body={"cache_salt": "tenant-b"}
    )
    again = client.completions.create(
        model=served.model, prompt=text, max_tokens=2, extra_body={"cache_salt": "tenant-b"}
    )
    assert completion.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == _full(again.usage.prompt_tokens)
    after = wait_until_idle(served)
    queries = metric(after, "trtllm_prefix_cache_queries_total") - metric(
        before, "trtllm_prefix_cache_queries_total"
    )
    hits = metric(after, "trtllm_prefix_cache_hits_total") - metric(
        before, "trtllm_prefix_cache_hits_total"
    )
    assert queries >= 2 * prompt and hits >= cached
