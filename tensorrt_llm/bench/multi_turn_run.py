"""Run `--multi_turn` conversations: in process through `LLM`'s chat path, or served over HTTP.

`concurrency` conversations run at once; inside one, each turn waits for the previous answer,
whose text goes into the next turn's history. Turn 1's text is sized by a probe so that its
prompt is `isl` tokens as the engine counts them (template and vision tokens included).

Warm-up uses conversations of their own (another seed): once a prefix cache exists, warming up
on the measured conversations would make their first turn a cache hit.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..sampling_params import SamplingParams
from .metrics import RequestTiming
from .multi_turn import (
    Conversation,
    TurnSample,
    make_conversations,
    run_row,
    summarize_turns,
    turn_messages,
)
from .peak import LLM_INTERVAL_S, SERVED_INTERVAL_S, PeakSampler, llm_running, served_running
from .served import (
    CHAT_PATH,
    ServedTarget,
    messages_body,
    png_data_url,
    scrape,
    stage_means,
    stage_sums,
    stream_timing,
    workload_images,
)
from .sse_client import post_stream
from .workload import Workload

_PROBE_WORDS = 8
_WARM_UP_SEED = 1000


@dataclass(frozen=True)
class MultiTurnSpec:
    turns: int
    turn_tokens: int  # new user text per later turn, in one-token words


# NOTE: a random-weight answer comes back as text, and most of its ids are the bench tokenizer's
# filler words (workload.cover_vocab), which no merge rebuilds: re-encoded, each is up to 5
# tokens (about 4.2 on average for a real vocab). A history thus grows by ~4x the answer's
# tokens; the per-turn prompt_tokens_mean column shows the real lengths.
_ANSWER_REENCODE_MAX = 5
_TEMPLATE_TOKENS_PER_TURN = 16  # the assistant and user messages' role and end tokens


def max_prompt_len(isl: int, osl: int, spec: MultiTurnSpec) -> int:
    """An upper bound of the last turn's prompt: each turn adds a question, an answer (as
    re-encoded text) and the template tokens of two messages."""
    per_turn = spec.turn_tokens + _ANSWER_REENCODE_MAX * osl + _TEMPLATE_TOKENS_PER_TURN
    return isl + (spec.turns - 1) * per_turn


def _raise_on_error(out: Any) -> None:
    if out.error:
        raise RuntimeError(f"multi-turn request failed: {out.error}")


# ---- in process --------------------------------------------------------------------------------
def _llm_params(workload: Workload) -> SamplingParams:
    # detokenize: the answer's text is the next turn's assistant message.
    return SamplingParams(
        max_tokens=workload.osl, temperature=0.0, ignore_eos=workload.ignore_eos, detokenize=True
    )


def llm_conversations(
    llm: Any, config: Any, workload: Workload, words: list[str], spec: MultiTurnSpec, count: int
) -> list[Conversation]:
    """`count` conversations whose turn 1 is `workload.isl` tokens, images as PIL parts."""
    images = workload_images(config, replace(workload, num_requests=count))
    parts = [[{"type": "image", "image": image} for image in imgs] for imgs in images]
    probe = make_conversations(parts[:1], words, _PROBE_WORDS, spec.turn_tokens, 1)[0]
    prompt = llm.prepare({"prompt": turn_messages(probe, [])}).prompt_token_ids
    first_words = workload.isl - (len(prompt) - _PROBE_WORDS)
    if first_words < 1:
        raise ValueError(
            f"isl {workload.isl} leaves no room for text: the chat template and "
            f"{workload.images_per_request} image(s) already take {len(prompt) - _PROBE_WORDS}"
        )
    return make_conversations(
        parts, words, first_words, spec.turn_tokens, spec.turns, seed=workload.seed
    )


async def _llm_conversation(
    llm: Any, conversation: Conversation, params: SamplingParams
) -> list[TurnSample]:
    answers: list[str] = []
    samples = []
    for turn in range(1, conversation.turns + 1):
        prompt = {"prompt": turn_messages(conversation, answers)}
        start = time.perf_counter()
        first = None
        handle = llm.generate_async(prompt, params, streaming=True)
        async for out in handle:
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
        end = time.perf_counter()
        _raise_on_error(handle)
        count = len(handle.outputs[0].token_ids)
        timing = RequestTiming(start, first if first is not None else end, end, count)
        prompt_len = len(handle.prompt_token_ids)
        samples.append(TurnSample(turn, timing, prompt_len, handle.num_cached_tokens))
        answers.append(handle.outputs[0].text)
    return samples


async def _llm_all(
    llm: Any, conversations: list[Conversation], params: SamplingParams
) -> list[TurnSample]:
    runs = await asyncio.gather(*(_llm_conversation(llm, c, params) for c in conversations))
    return [s for run in runs for s in run]


def run_multi_turn_llm(
    llm: Any,
    config: Any,
    workload: Workload,
    words: list[str],
    spec: MultiTurnSpec,
    concurrency: int,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(the run's row, one row per turn) of `concurrency` conversations in process."""
    params = _llm_params(workload)
    warm = llm_conversations(
        llm, config, replace(workload, seed=_WARM_UP_SEED), words, replace(spec, turns=1), 2
    )
    asyncio.run(_llm_all(llm, warm, replace(params, max_tokens=min(8, workload.osl))))
    conversations = llm_conversations(llm, config, workload, words, spec, concurrency)
    with PeakSampler(llm_running(llm), LLM_INTERVAL_S) as peak:
        start = time.perf_counter()
        samples = asyncio.run(_llm_all(llm, conversations, params))
        wall = time.perf_counter() - start
    return run_row(samples, wall, concurrency, peak.peak), summarize_turns(samples, concurrency)


# ---- served --------------------------------------------------------------------------------------
def served_conversations(
    target: ServedTarget,
    config: Any,
    workload: Workload,
    words: list[str],
    first_words: int,
    spec: MultiTurnSpec,
    count: int,
) -> list[Conversation]:
    """`count` conversations with PNG data URLs; `first_words` (`text_tokens_for_isl`) makes
    turn 1 `isl` tokens as the server counts them."""
    images = workload_images(config, replace(workload, num_requests=count))
    parts = [
        [{"type": "image_url", "image_url": {"url": png_data_url(image)}} for image in imgs]
        for imgs in images
    ]
    return make_conversations(
        parts, words, first_words, spec.turn_tokens, spec.turns, seed=workload.seed
    )


async def _served_conversation(
    target: ServedTarget, conversation: Conversation, workload: Workload
) -> list[TurnSample]:
    answers: list[str] = []
    samples = []
    for turn in range(1, conversation.turns + 1):
        messages = turn_messages(conversation, answers)
        body = messages_body(target, messages, workload.osl, workload.ignore_eos)
        res = await post_stream(target.host, target.port, CHAT_PATH, body, keep_text=True)
        samples.append(TurnSample(turn, stream_timing(res), res.prompt_tokens, res.cached_tokens))
        answers.append(res.text)
    return samples


async def _served_all(
    target: ServedTarget, conversations: list[Conversation], workload: Workload
) -> list[TurnSample]:
    runs = await asyncio.gather(*(_served_conversation(target, c, workload) for c in conversations))
    return [s for run in runs for s in run]


def run_multi_turn_served(
    target: ServedTarget,
    config: Any,
    workload: Workload,
    words: list[str],
    first_words: int,
    spec: MultiTurnSpec,
    concurrency: int,
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """(the run's row, one row per turn) of `concurrency` conversations over HTTP."""
    warm_load = replace(workload, seed=_WARM_UP_SEED, osl=min(8, workload.osl))
    one_turn = replace(spec, turns=1)
    warm = served_conversations(target, config, warm_load, words, first_words, one_turn, 2)
    asyncio.run(_served_all(target, warm, warm_load))
    conversations = served_conversations(
        target, config, workload, words, first_words, spec, concurrency
    )
    reader = served_running(target.host, target.port)
    before = stage_sums(scrape(target))
    with PeakSampler(reader, SERVED_INTERVAL_S) as peak:
        start = time.perf_counter()
        samples = asyncio.run(_served_all(target, conversations, workload))
        wall = time.perf_counter() - start
    row = run_row(samples, wall, concurrency, peak.peak)
    row["isl_mean"] = float(np.mean([s.prompt_tokens for s in samples]))  # every turn's
    row.update(stage_means(before, stage_sums(scrape(target))))
    return row, summarize_turns(samples, concurrency)
