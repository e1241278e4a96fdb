"""Host-side input preparation: one prompt -> token ids, multimodal tensors, sampling params.

Everything that needs only the tokenizer and the input processor (no engine) lives here, so it
can run in the LLM's own thread or, for `trtllm-serve`, in a pool of worker processes
(serve/preprocess_pool.py) that each hold an `InputPreparer` of their own. The engine-side checks
(vocab range, will it ever fit) stay in `LLM._check_request`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from .._torch.pyexecutor.grammar_compile import check_grammar
from ..inputs.data import as_prompt_dict
from ..inputs.media_hash import MULTIMODAL_HASHES, MULTIMODAL_SOURCES, hash_multimodal_data
from ..inputs.multimodal import MultimodalParams
from ..inputs.utils import collect_multimodal_data, media_from_messages
from ..inputs.validation import (
    check_chat_messages,
    check_mm_processor_kwargs,
    check_prompt_token_ids,
    longest_token_bytes,
    max_prompt_bytes,
    prompt_text_bytes,
)
from ..sampling_params import SamplingParams
from .errors import PromptTooLongError
from .generation_defaults import GenerationDefaults
from .llm_args import LlmArgs

logger = logging.getLogger(__name__)


@dataclass
class PreparedRequest:
    """One input after host-side processing, ready to submit."""

    prompt: str | None
    prompt_token_ids: list[int]
    multimodal_params: MultimodalParams | None
    sampling_params: SamplingParams
    # The prompt's `cache_salt` (prefix-cache isolation; None: the shared namespace).
    cache_salt: str | None = None


class InputPreparer:
    """Validates and processes prompts on the host for one checkpoint."""

    def __init__(
        self,
        args: LlmArgs,
        tokenizer: Any,
        input_processor: Any,
        max_seq_len: int,
        generation_defaults: GenerationDefaults | None = None,
    ) -> None:
        self.args = args
        self._tokenizer = tokenizer
        self.input_processor = input_processor
        self._max_seq_len = max_seq_len
        # Computed once: a prompt with more text bytes than max_seq_len tokens of this size can
        # hold is rejected before it is tokenized (tokenizing 10 MB takes seconds).
        self._max_prompt_bytes = max_prompt_bytes(max_seq_len, longest_token_bytes(tokenizer))
        # The checkpoint's generation_config.json (args.generation_config); LLM reads it once
        # and logs it, preprocess workers read their own copy.
        if generation_defaults is None:
            generation_defaults = GenerationDefaults.from_checkpoint(
                args.model, args.generation_config
            )
        self.generation_defaults = generation_defaults
        self._extra_eos_ids = list(generation_defaults.eos_token_ids)
        # Media content hashes name the images in the KV block keys: computed here, once per
        # request on the host (in the preprocess workers when the server has them), never in
        # the engine loop; only when block reuse is on (a 1024x1024 image costs ~31 ms).
        self._hash_media = args.resolve_block_reuse(getattr(input_processor, "config", None))

    def prepare(self, inputs: Any, sampling_params: SamplingParams | None) -> PreparedRequest:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(
                f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}"
            )
        if sampling_params.guided_decoding is not None:
            # A bad schema/regex/grammar is the caller's ValueError now, not an engine error.
            check_grammar(sampling_params.guided_decoding)
        # The checkpoint's defaults fill what the request left unset, before the end ids.
        sampling_params = self.with_end_ids(self.generation_defaults.apply(sampling_params))
        prompt = as_prompt_dict(inputs)
        self._check_prompt_fields(prompt)
        self._check_mm_limits(prompt)
        defaults = self.args.mm_processor_kwargs
        if defaults:
            given = prompt.get("mm_processor_kwargs") or {}
            prompt["mm_processor_kwargs"] = {**defaults, **given}
        prompt["mm_processor_kwargs"] = check_mm_processor_kwargs(prompt.get("mm_processor_kwargs"))
        try:
            ids, extra = self.input_processor(prompt, sampling_params)
        except (ValueError, TypeError):
            raise  # our own checks: the message names the field
        except Exception as exc:  # a processor failing deep inside PIL or numpy
            # NOTE: the raw text can expose internals (object reprs, C-level overflow texts);
            # the caller gets the stage and the type, the log gets the traceback.
            logger.warning("input processing failed", exc_info=True)
            raise ValueError(
                f"input processing failed ({type(exc).__name__}); check the prompt's media "
                f"and mm_processor_kwargs"
            ) from exc
        # The decoded items never leave with the request (they are large and host-only).
        sources = (extra or {}).pop(MULTIMODAL_SOURCES, None)
        mm_data = (extra or {}).get("multimodal_data")
        if mm_data and self._hash_media:
            hashes = hash_multimodal_data(mm_data, prompt["mm_processor_kwargs"], sources)
            if hashes:
                mm_data[MULTIMODAL_HASHES] = hashes
        mm_params = MultimodalParams(multimodal_data=mm_data) if mm_data else None
        text = prompt.get("prompt")
        return PreparedRequest(
            prompt=text if isinstance(text, str) else None,
            prompt_token_ids=list(ids),
            multimodal_params=mm_params,
            sampling_params=sampling_params,
            cache_salt=prompt.get("cache_salt"),
        )

    def _check_prompt_fields(self, prompt: dict[str, Any]) -> None:
        """Field types first, then a prompt too long by its byte count alone, untokenized."""
        text = prompt.get("prompt")
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        if "prompt_token_ids" in prompt:
            if isinstance(text, list):
                # A text `prompt` beside ids is only their display text; chat messages would
                # be a second prompt, dropped unread.
                raise ValueError(
                    "give chat messages as `prompt` or token ids as `prompt_token_ids`, not both"
                )
            prompt["prompt_token_ids"] = check_prompt_token_ids(prompt["prompt_token_ids"])
        elif isinstance(text, list):
            check_chat_messages(text, field="prompt")
        size = prompt_text_bytes(text)
        if size > self._max_prompt_bytes:
            raise PromptTooLongError(
                f"the prompt has {size} bytes of text, more than max_seq_len="
                f"{self._max_seq_len} tokens can hold (at most {self._max_prompt_bytes} bytes)"
            )

    def with_end_ids(self, sp: SamplingParams) -> SamplingParams:
        """Fill end/pad ids from the tokenizer; with the default end id, the checkpoint's
        generation_config end ids stop generation too (as they do in HF generate)."""
        default_end = sp.end_id is None
        sp = sp.with_tokenizer(self._tokenizer)
        extra = [e for e in self._extra_eos_ids if e != sp.end_id]
        if default_end and not sp.ignore_eos and extra:
            have = list(sp.stop_token_ids or [])
            sp = replace(sp, stop_token_ids=have + [e for e in extra if e not in have])
        return sp

    def _check_mm_limits(self, prompt: dict[str, Any]) -> None:
        limits = self.args.limit_mm_per_prompt
        if not limits:
            return
        data = collect_multimodal_data(prompt.get("multi_modal_data"))
        counts = {k: len(v) for k, v in data.items()}
        if isinstance(prompt.get("prompt"), list):
            for k, v in media_from_messages(prompt["prompt"]).items():
                counts[k] = counts.get(k, 0) + len(v)
        for modality, limit in limits.items():
            if counts.get(modality, 0) > limit:
                raise ValueError(
                    f"too many {modality} inputs: {counts[modality]} given, "
                    f"limit_mm_per_prompt allows {limit}"
                )
