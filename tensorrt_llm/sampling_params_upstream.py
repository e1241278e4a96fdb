"""TensorRT-LLM's (and vLLM's) `SamplingParams` arguments this project does not have, each
with what to do instead: `SamplingParams(beam_width=4)` is a ValueError saying so, not
Python's bare "unexpected keyword argument" (nor a silent no-op)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_NO_BEAMS = "there is no beam search; sample n independent sequences with n"
_NO_LOGITS = "logits are not returned; ask for logprobs / prompt_logprobs instead"
_NOT_HERE = "not supported by this engine"

# Upstream argument -> why it is refused and what to use.
UPSTREAM_ONLY_FIELDS: dict[str, str] = {
    "beam_width": _NO_BEAMS,
    "use_beam_search": _NO_BEAMS,
    "best_of": _NO_BEAMS,
    "length_penalty": _NO_BEAMS,
    "early_stopping": _NO_BEAMS,
    "beam_search_diversity_rate": _NO_BEAMS,
    "num_return_sequences": "use n (the number of sequences returned)",
    "return_context_logits": _NO_LOGITS,
    "return_generation_logits": _NO_LOGITS,
    "exclude_input_from_output": "outputs never include the prompt (upstream's default)",
    "bad": "use bad_words (a list of strings)",
    "bad_token_ids": "use logit_bias with -100 for each id",
    "stop_words": "use stop (a list of strings) or stop_token_ids",
    "embedding_bias": "use logit_bias (token id -> bias)",
    "add_special_tokens": "prompts are tokenized as the checkpoint's tokenizer does; give "
    "prompt_token_ids to choose the tokens yourself",
    "truncate_prompt_tokens": "prompts are never truncated; a prompt that does not fit is an "
    "error naming max_seq_len",
    "no_repeat_ngram_size": _NOT_HERE,
    "top_p_min": _NOT_HERE,
    "top_p_decay": _NOT_HERE,
    "top_p_reset_ids": _NOT_HERE,
    "lookahead_config": _NOT_HERE,
    "logits_processor": _NOT_HERE,
    "apply_batched_logits_processor": _NOT_HERE,
    "return_perf_metrics": _NOT_HERE,
    "return_encoder_output": _NOT_HERE,
    "additional_model_outputs": _NOT_HERE,
}


def check_upstream_kwargs(kwargs: Mapping[str, Any]) -> None:
    """A ValueError naming the first upstream-only argument in `kwargs`, if any."""
    for name in kwargs:
        why = UPSTREAM_ONLY_FIELDS.get(name)
        if why is not None:
            raise ValueError(f"SamplingParams({name}=...) is not supported: {why}")
