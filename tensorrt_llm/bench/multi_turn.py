"""Multi-turn conversations (`trtllm-bench --multi_turn N`): the workload a prefix cache serves.

Each conversation opens with the image(s) and ~isl tokens of text; every later turn resends the
whole history (turn 1's message with its images, each previous answer as an assistant message,
each previous question) plus a new question of `turn_tokens` one-token words. So turn k's prompt
starts with turn k-1's prompt and answer: what a prefix cache can skip. The history is built as
chat messages, in process and served alike, so the chat template renders it the same way.

Nothing here runs a model: `turn_messages` is a pure function of a conversation and its answers
so far, and `summarize_turns` turns the per-turn samples into the table's rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .metrics import RequestTiming, summarize

# The per-turn table: TTFT grows with the history unless a prefix cache absorbs it.
TURN_COLUMNS = (
    "concurrency",
    "turn",
    "requests",
    "prompt_tokens_mean",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "latency_ms_p50",
    "prefix_hit_rate",
)


@dataclass(frozen=True)
class Conversation:
    # Turn 1's image content parts, in the form the caller sends: {"type": "image", "image":
    # PIL image} in process, {"type": "image_url", ...} data URLs over HTTP.
    image_parts: list[dict[str, Any]]
    first_text: str  # turn 1's text, after the images
    questions: list[str]  # the new user text of turns 2..N

    @property
    def turns(self) -> int:
        return 1 + len(self.questions)


@dataclass(frozen=True)
class TurnSample:
    turn: int  # 1-based
    timing: RequestTiming
    prompt_tokens: int  # the engine's count: template, history and vision tokens included
    cached_tokens: int  # of those, served from the prefix cache


def random_text(rng: np.random.Generator, words: Sequence[str], count: int) -> str:
    """`count` words, each after a space so that each stays one token whatever precedes it."""
    return "".join(" " + words[i] for i in rng.integers(0, len(words), count))


def make_conversations(
    image_parts: Sequence[list[dict[str, Any]]],
    words: Sequence[str],
    first_words: int,
    turn_tokens: int,
    turns: int,
    seed: int = 0,
) -> list[Conversation]:
    """One conversation per entry of `image_parts` (turn 1's images), seeded."""
    if turns < 1:
        raise ValueError(f"a conversation has at least one turn, got {turns}")
    rng = np.random.default_rng(seed + 2)
    return [
        Conversation(
            list(parts),
            random_text(rng, words, first_words),
            [random_text(rng, words, turn_tokens) for _ in range(turns - 1)],
        )
        for parts in image_parts
    ]


def turn_messages(conversation: Conversation, answers: Sequence[str]) -> list[dict[str, Any]]:
    """The chat messages of turn len(answers) + 1: the whole history, then the new question.

    `answers[i]` is the model's answer to turn i + 1, sent back as an assistant message.
    """
    turn = len(answers) + 1
    if turn > conversation.turns:
        raise ValueError(f"the conversation has {conversation.turns} turns, not {turn}")
    first = [*conversation.image_parts, {"type": "text", "text": conversation.first_text}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
    for answer, question in zip(answers, conversation.questions[: turn - 1], strict=True):
        messages.append({"role": "assistant", "content": answer})
        messages.append({"role": "user", "content": question})
    return messages


def summarize_turns(samples: Sequence[TurnSample], concurrency: int) -> list[dict[str, float]]:
    """One row per turn: TTFT/ITL/latency percentiles, the mean prompt length and the prefix
    cache's hit rate (cached prompt tokens / prompt tokens of that turn's requests)."""
    rows = []
    for turn in sorted({s.turn for s in samples}):
        mine = [s for s in samples if s.turn == turn]
        # The wall time is the conversations', not the turn's: throughput is the run row's.
        row = summarize([s.timing for s in mine], wall=1.0, concurrency=concurrency)
        for key in ("output_tok_s", "wall_s", "per_user_tok_s"):
            row.pop(key)
        prompt = sum(s.prompt_tokens for s in mine)
        cached = sum(s.cached_tokens for s in mine)
        row["turn"] = turn
        row["prompt_tokens_mean"] = prompt / len(mine)
        row["cached_tokens"] = cached
        row["prompt_tokens"] = prompt
        row["prefix_hit_rate"] = cached / prompt if prompt else 0.0
        rows.append(row)
    return rows


def run_row(
    samples: Sequence[TurnSample], wall: float, concurrency: int, peak: int | None
) -> dict[str, float]:
    """The whole run as one row of the usual table (throughput over every turn's output), plus
    the overall hit rate, the engine's peak of running requests (nan when unknown) and the TTFT
    p50 of every request past turn 1 pooled (`later_turns_ttft_ms_p50`: the figure a prefix
    cache is judged by, one percentile over turns 2..N rather than a mean of per-turn ones)."""
    row = summarize([s.timing for s in samples], wall, concurrency)
    prompt = sum(s.prompt_tokens for s in samples)
    row["prefix_hit_rate"] = sum(s.cached_tokens for s in samples) / prompt if prompt else 0.0
    row["peak_running"] = float("nan") if peak is None else float(peak)
    later = [s.timing for s in samples if s.turn > 1]
    if later:
        row["later_turns_ttft_ms_p50"] = summarize(later, 1.0, concurrency)["ttft_ms_p50"]
    return row
