"""trtllm-bench with MTP speculative decoding: `--speculative_config` and `--draft_mode`.

Random weights accept almost no MTP draft, so two labelled modes bound what speculation can
do on this hardware, and `model` measures the head as it is:

- `model`: the MTP head's own drafts.
- `oracle`: every draft is the target's own greedy continuation, so all are accepted (the
  upper bound: time per output token with acceptance length 1 + k).
- `rejected`: every first draft is wrong, so none is accepted (the lower bound: the cost of
  drafting, verifying 1 + k tokens and rolling the recurrent state back, for one token).

The two bounds need the continuation first: a recording wave (the same prompts, untimed
for the result) keeps each request's greedy output, keyed by its prompt tokens; the timed
wave then replaces the head's drafts with it (oracle) or with tokens one off it (rejected).
The head still runs in every mode, so its cost is in every figure. Drafts past the recorded
output (the last step of a request) stay the head's own.
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
        help="model: the MTP head's drafts; oracle: the target's own greedy continuation (all "
        "accepted); rejected: none accepted (recording wave first for both)",
    )


def check_spec_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.speculative_config is None:
        if args.draft_mode != "model":
            p.error("--draft_mode goes with --speculative_config")
        return
    if args.served or args.served_url:
        p.error("--speculative_config runs in process only (drafts are set inside the engine)")
    if args.draft_mode != "model" and (args.multi_turn or args.max_tokens_dist):
        p.error(
            "--draft_mode oracle/rejected replays a plain wave's prompts; drop --multi_turn "
            "and --max_tokens_dist"
        )
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


def run_spec_wave(llm: Any, args: argparse.Namespace, wave: Callable[[], Rows]) -> Rows:
    """`wave()` as the draft mode says, its row with `draft_mode` and `acceptance_length`."""
    decoder = llm._executor.spec_decoder if args.speculative_config is not None else None
    if decoder is None:
        return wave()
    mode = args.draft_mode
    if mode != "model":
        outputs: dict[tuple[int, ...], list[int]] = {}

        def record(req: Any, drafts: list[int]) -> list[int]:
            outputs[tuple(int(t) for t in req.prompt_token_array)] = list(req.output_token_ids)
            return drafts

        decoder.draft_override = record
        wave()  # the recording wave
        vocab = decoder.drafter.vocab_size
        decoder.draft_override = _replay(outputs, 0 if mode == "oracle" else 1, vocab)
    before = _stats(decoder)
    try:
        row, turns = wave()
    finally:
        decoder.draft_override = None
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


def _replay(
    outputs: dict[tuple[int, ...], list[int]], shift: int, vocab: int
) -> Callable[[Any, list[int]], list[int]]:
    """Drafts = the recorded continuation (+ `shift` mod the vocab: 1 never matches), the
    head's own where nothing was recorded."""

    def override(req: Any, drafts: list[int]) -> list[int]:
        cont = outputs.get(tuple(int(t) for t in req.prompt_token_array))
        if cont is None:
            return drafts
        done = req.num_generated_tokens
        out = list(drafts)
        for j in range(len(drafts)):
            if done + j < len(cont):
                out[j] = (cont[done + j] + shift) % vocab
        return out

    return override
