"""trtllm-bench with MTP speculative decoding: `--speculative_config` and `--draft_mode`.

Random weights accept almost no MTP draft, so two labelled modes bound what speculation can
do on this hardware, and `model` measures the head as it is:

- `model`: the MTP head's own drafts, accepted where the target agrees.
- `oracle`: every draft is accepted (the upper bound: time per output token with acceptance
  length 1 + k, no rollback).
- `rejected`: no draft is accepted (the lower bound: the cost of drafting, verifying 1 + k
  tokens and rolling the recurrent state back, for one token).

The two bounds force the verify step's decision (`SpecDecoder.accept_override`); every
forward runs as in a real step, so only the emitted tokens differ: an accepted draft is
emitted as drafted, then the target's token after it. An earlier design replayed a recorded
greedy continuation as the drafts; in bf16 at real size, with random weights' near-tied
logits, the verify shapes changed the argmax and only about half of those "oracle" drafts
were accepted (benchmarks/results/qwen3_6_27b_h200.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ..serve.server_args import parse_speculative_config_arg

DRAFT_MODES = ("model", "oracle", "rejected")
Rows = tuple[dict[str, float], list[dict[str, float]]]


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative_config",
        type=parse_speculative_config_arg,
        default=None,
        metavar="JSON|FILE",
        help='e.g. \'{"decoding_type": "MTP", "num_nextn_predict_layers": 3}\' (in process, '
        "with the default executor, as the run without it); prints the acceptance length",
    )
    g.add_argument(
        "--draft_mode",
        choices=DRAFT_MODES,
        default="model",
        help="model: the MTP head's drafts, accepted where the target agrees; oracle: every "
        "draft accepted (upper bound); rejected: none accepted (lower bound)",
    )


def check_spec_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.speculative_config is None:
        if args.draft_mode != "model":
            p.error("--draft_mode goes with --speculative_config")
        return
    if args.served or args.served_url:
        p.error("--speculative_config runs in process only (drafts are set inside the engine)")
    if args.executor_mode == "process":
        p.error("--speculative_config needs --executor_mode inproc (the default with it)")


def spec_llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) arguments for the flags ({} without --speculative_config)."""
    if args.speculative_config is None:
        return {}
    return {
        "speculative_config": args.speculative_config,
        "executor_mode": "inproc",
    }


def _stats(decoder: Any) -> tuple[int, int, int]:
    stats = decoder.stats
    return stats.num_verify_rows, stats.num_accepted_tokens, stats.num_draft_tokens


def _accept_all(num_drafts: int) -> int:
    return num_drafts


def _accept_none(num_drafts: int) -> int:
    return 0


def run_spec_wave(llm: Any, args: argparse.Namespace, wave: Callable[[], Rows]) -> Rows:
    """`wave()` as the draft mode says, its row with `draft_mode` and `acceptance_length`."""
    decoder = llm._executor.spec_decoder if args.speculative_config is not None else None
    if decoder is None:
        return wave()
    mode = args.draft_mode
    forced = {"oracle": _accept_all, "rejected": _accept_none}.get(mode)
    before = _stats(decoder)
    decoder.accept_override = forced
    try:
        row, turns = wave()
    finally:
        decoder.accept_override = None
    rows, accepted, drafted = (a - b for a, b in zip(_stats(decoder), before, strict=True))
    # Tokens a verify row emits on average, and the share of drafts accepted.
    row["acceptance_length"] = 1.0 + accepted / rows if rows else 0.0
    row["draft_acceptance_rate"] = accepted / drafted if drafted else 0.0
    print(
        f"draft_mode={mode}: acceptance length {row['acceptance_length']:.3f}, "
        f"{row['draft_acceptance_rate']:.1%} of {drafted} drafts accepted",
        flush=True,
    )
    return row, turns
