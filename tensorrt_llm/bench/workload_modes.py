"""trtllm-bench's workload shapes besides the plain wave: their flags, the checks of how they
combine with the others, and one wave of each, in process or served.

plain: `num_requests` single-turn requests, `concurrency` in flight (runner.py / served.py).
--multi_turn N: `concurrency` conversations of N turns each (multi_turn.py).
--max_tokens_dist LO HI: plain requests that stop after a drawn length (early_stop.py).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

from .early_stop import draw_stops, run_early_stop_llm, run_early_stop_served
from .metrics import PHASE_COLUMNS
from .multi_turn_run import MultiTurnSpec, max_prompt_len, run_multi_turn_llm, run_multi_turn_served
from .runner import run_concurrency, sampling_params, warm_up
from .served import (
    ServedTarget,
    build_contents,
    run_served_concurrency,
    single_token_words,
    warm_up_served,
)
from .workload import Workload, make_requests

Rows = tuple[dict[str, float], list[dict[str, float]]]
# The extra columns of --multi_turn / --max_tokens_dist runs (each row has those of its mode).
_MODE_COLUMNS = (
    "prefix_hit_rate",
    "later_turns_ttft_ms_p50",
    "stop_tokens_mean",
    "overshoot_tokens_mean",
    "peak_running",
    "acceptance_length",
)


def table_columns(rows: list[dict[str, float]], base: tuple[str, ...]) -> tuple[str, ...]:
    """`base`, then the mode and TTFT-phase columns the rows carry."""
    extra = (*_MODE_COLUMNS, *PHASE_COLUMNS)
    return (*base, *(c for c in extra if rows and c in rows[0]))


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload shape")
    g.add_argument(
        "--multi_turn",
        type=int,
        default=None,
        metavar="N",
        help="each of --concurrency conversations has N turns; later turns resend the whole "
        "history (images included) plus a new question; prints TTFT and the prefix-cache hit "
        "rate per turn",
    )
    g.add_argument(
        "--turn_tokens",
        type=int,
        default=1000,
        help="with --multi_turn: new user text per later turn, in tokens (the history growth)",
    )
    g.add_argument(
        "--max_tokens_dist",
        type=int,
        nargs=2,
        default=None,
        metavar=("LO", "HI"),
        help="every request asks for --osl tokens but stops after a length drawn uniformly "
        "from [LO, HI] (seeded), like thinking traces; the client cancels it there",
    )


def check_workload_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject the combinations that do not make sense (or are not supported yet)."""
    multi, dist = args.multi_turn is not None, args.max_tokens_dist is not None
    if multi and args.multi_turn < 1:
        p.error("--multi_turn takes a number of turns >= 1")
    if args.turn_tokens < 1:
        p.error("--turn_tokens must be >= 1")
    if multi and dist:
        p.error("--multi_turn and --max_tokens_dist do not combine (yet): pick one")
    if not (multi or dist):
        return
    flag = "--multi_turn" if multi else "--max_tokens_dist"
    # guided output is not wired into these paths; the HF baseline runs plain waves only.
    for name, given in (("--guided_json", args.guided_json), ("--hf_baseline", args.hf_baseline)):
        if given:
            p.error(f"{flag} does not support {name}")
    if multi and args.num_requests is not None:
        p.error("--multi_turn runs --concurrency conversations; --num_requests does not apply")
    if dist:
        low, high = args.max_tokens_dist
        if not 1 <= low <= high <= args.osl:
            p.error(f"--max_tokens_dist needs 1 <= LO <= HI <= --osl ({args.osl}): {low} {high}")


def max_seq_len(args: argparse.Namespace) -> int:
    """The engine's max_seq_len for the run: the longest prompt plus --osl, plus slack."""
    if getattr(args, "multi_turn", None):
        spec = MultiTurnSpec(args.multi_turn, args.turn_tokens)
        return max_prompt_len(args.isl, args.osl, spec) + args.osl + 8
    return args.isl + args.osl + 8


# Warm-up prompts come from another seed than the measured ones, and every wave has its own
# seed (its concurrency): with prefix caching on (the default), a prompt seen before would be
# a cache hit and skip its prefill, and the wave would time the cache, not the engine.
_WARM_UP_SEED = 1_000_003


def _workload(args: argparse.Namespace, concurrency: int, guided: str | None) -> Workload:
    n = args.num_requests or max(concurrency, 2)
    return Workload(
        args.isl, args.osl, args.images_per_request, args.image_size, n, args.ignore_eos,
        seed=concurrency, guided_json=guided,
    )  # fmt: skip


def _warm_up_workload(workload: Workload) -> Workload:
    """Four requests shaped like the wave's, none of them in it."""
    return replace(workload, seed=workload.seed + _WARM_UP_SEED, num_requests=4)


def _stops(args: argparse.Namespace, workload: Workload) -> list[int]:
    low, high = args.max_tokens_dist
    return draw_stops(low, high, workload.num_requests, workload.seed)


def wave_ours(
    llm: Any, config: Any, folder: Path, args: argparse.Namespace, c: int, guided: str | None
) -> Rows:
    """One in-process wave at concurrency `c`: (its row, its per-turn rows or [])."""
    workload = _workload(args, c, guided)
    if args.multi_turn:
        words = single_token_words(folder / "tokenizer.json")
        spec = MultiTurnSpec(args.multi_turn, args.turn_tokens)
        return run_multi_turn_llm(llm, config, workload, words, spec, c)
    prompts = make_requests(config, workload)
    warm_up(llm, make_requests(config, _warm_up_workload(workload)), workload)
    if args.max_tokens_dist:
        stops = _stops(args, workload)
        return run_early_stop_llm(llm, prompts, sampling_params(workload), stops, c), []
    return run_concurrency(llm, prompts, workload, c), []


def wave_served(
    target: ServedTarget,
    config: Any,
    args: argparse.Namespace,
    words: list[str],
    num_text: int,
    c: int,
    guided: str | None,
) -> Rows:
    """One served wave at concurrency `c`: (its row, its per-turn rows or [])."""
    workload = _workload(args, c, guided)
    if args.multi_turn:
        spec = MultiTurnSpec(args.multi_turn, args.turn_tokens)
        return run_multi_turn_served(target, config, workload, words, num_text, spec, c)
    contents = build_contents(config, workload, words, num_text)
    warm_up_served(target, build_contents(config, _warm_up_workload(workload), words, num_text))
    if args.max_tokens_dist:
        stops = _stops(args, workload)
        return run_early_stop_served(target, contents, workload, stops, c), []
    return run_served_concurrency(target, contents, workload, c), []
