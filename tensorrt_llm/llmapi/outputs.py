"""RequestOutput / CompletionOutput: what `LLM.generate` returns, and the text they carry.

`CompletionState` turns the token ids of one completion into text as they arrive: it detokenizes
incrementally (only a short window of tokens is decoded per update, so long streams stay linear)
and cuts the text at the first stop string. This is the only place stop strings are checked:
the engine stops on token ids only and is cancelled when a stop string shows up here.
A non-streaming completion without stop strings decodes once, when it finishes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .logprobs import PromptLogprobs, TokenLogprobs, to_token_logprobs

if TYPE_CHECKING:
    from .._torch.pyexecutor.executor_types import RequestMetrics

# A decode that ends in U+FFFD stopped inside a multi-byte character: wait for more tokens.
_REPLACEMENT_CHAR = "\ufffd"


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    finish_reason: "stop" (end id, stop token or stop string), "length" (max_tokens or
    max_seq_len), "cancelled", "error", or None while running. stop_reason: the stop token id
    or stop string that ended it, if any.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # With SamplingParams.logprobs: one dict per token id (TensorRT-LLM's TokenLogprobs), and
    # the sum of the sampled tokens' logprobs.
    logprobs: TokenLogprobs = field(default_factory=list)
    cumulative_logprob: float | None = None
    # With SamplingParams.prompt_logprobs (TensorRT-LLM keeps them here too): the request's
    # `RequestOutput.prompt_logprobs`, the same list.
    prompt_logprobs: PromptLogprobs | None = None
    # Lengths before the latest update, so streaming consumers can read just the delta.
    _last_text_len: int = field(default=0, repr=False)
    _last_token_ids_len: int = field(default=0, repr=False)
    _last_logprobs_len: int = field(default=0, repr=False)

    @property
    def text_diff(self) -> str:
        """Text added by the latest update."""
        return self.text[self._last_text_len :]

    @property
    def token_ids_diff(self) -> list[int]:
        """Token ids added by the latest update."""
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> TokenLogprobs:
        """Logprobs of the tokens added by the latest update."""
        return self.logprobs[self._last_logprobs_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The outputs of one prompt: `outputs` has `SamplingParams.n` completions.

    `error` is set (and every completion has finish_reason "error") when the request failed
    inside the executor; other requests are unaffected. `error_code` says why, without parsing
    the message: "prompt_too_long" (it can never fit this engine), "shutting_down" or
    "engine_error".
    `num_cached_tokens` (vLLM's name): prompt tokens whose KV came from the prefix cache instead
    of a prefill at the request's first admission (kv_cache_config.enable_block_reuse); with
    n > 1, the first completion's. Whole KV blocks only, and never the prompt's last token.
    `metrics` (vLLM's name): the engine's timestamps of the request (`RequestMetrics`: arrival,
    first scheduled, first token, finished), set when it finishes in the engine; with n > 1,
    the first completion's; None until then, or when a stop string ended it on this side.
    """

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    error_code: str | None = None
    num_cached_tokens: int = 0
    # vLLM's: with SamplingParams.prompt_logprobs, one entry per prompt token (None first),
    # set with the first update after the prompt's prefill.
    prompt_logprobs: PromptLogprobs | None = None
    metrics: RequestMetrics | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def text(self) -> str:
        """Text of the first completion (a shortcut for the common n == 1 case)."""
        return self.outputs[0].text

    def snapshot(self) -> RequestOutput:
        """A detached copy: later updates to this object do not show in it."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_detached(o) for o in self.outputs],
            finished=self.finished,
            error=self.error,
            error_code=self.error_code,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
            metrics=self.metrics,
        )


def _detached(output: CompletionOutput) -> CompletionOutput:
    out = copy.copy(output)
    if output.logprobs:
        # A stream consumer reads a snapshot's logprobs after later updates may have landed.
        out.logprobs = list(output.logprobs)
    return out


def _backend_decoder(tokenizer: Any, spaces_between_special_tokens: bool) -> Any | None:
    """The Rust `tokenizers.Tokenizer` behind an HF fast tokenizer when decoding through it
    gives exactly `tokenizer.decode` (no clean-up pass), else None.

    NOTE: the HF wrapper's argument conversion costs several times the Rust decode itself; the
    streaming front end decodes twice per update of every stream, so this is its hot spot.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return None
    if not spaces_between_special_tokens and not getattr(tokenizer, "is_fast", True):
        return None  # only the slow tokenizers' decode reads it
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class IncrementalDetokenizer:
    """Decodes a growing token list, decoding only a short window per update.

    NOTE: `prefix_offset..read_offset` is the window already turned into text; each update decodes
    `prefix_offset..end` and keeps the part beyond the window's text, so tokens that merge with
    their neighbour (byte-level BPE pieces of one character) come out right.
    """

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # Passed only when not the default: fast tokenizers ignore it, some custom ones lack it.
        self._decode_kwargs = (
            {} if spaces_between_special_tokens else {"spaces_between_special_tokens": False}
        )
        self._backend = _backend_decoder(tokenizer, spaces_between_special_tokens)
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self._skip)
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip, **self._decode_kwargs)

    def append(self, new_ids: list[int]) -> None:
        """Append tokens without decoding (the text is made by `finish`)."""
        self.token_ids.extend(new_ids)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (may be "" mid-character)."""
        self.token_ids.extend(new_ids)
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = full[len(prefix) :]
        self.text += delta
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        return delta

    def finish(self) -> str:
        """Decode everything once more (flushes a trailing partial character); return the text."""
        self.text = self._decode(self.token_ids)
        return self.text


class CompletionState:
    """Turns the token stream of one completion into `CompletionOutput.text`.

    Stop strings: the text is cut before the first stop string (or after it with
    `include_stop_str_in_output`). While the completion runs, the last `max_stop_len - 1`
    characters are held back, so a streamed prefix never shows text a stop string later removes.
    final_text_only: nobody reads the text before the end (not streaming) and there are no stop
    strings to look for: decode once in `finish` instead of on every update.
    min_tokens: as in vLLM, a stop string only counts when it ends in the text of a token after
    the first `min_tokens` (the engine holds off stop ids the same way).
    """

    def __init__(
        self,
        output: CompletionOutput,
        tokenizer: Any | None,
        stop: list[str],
        include_stop_str: bool = False,
        detokenize: bool = True,
        final_text_only: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.output = output
        self._min_tokens = min_tokens
        self._stops_from = 0  # a stop string must end after this text offset
        self._stop = stop
        self._lazy = final_text_only and not stop
        self._include_stop = include_stop_str
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._searched = 0  # text before this offset (minus the holdback) holds no stop string
        self._detok = (
            IncrementalDetokenizer(tokenizer, skip_special_tokens, spaces_between_special_tokens)
            if (detokenize and tokenizer is not None)
            else None
        )

    def begin_update(self) -> None:
        """Mark the current lengths, so `text_diff`/`token_ids_diff` show only what follows."""
        self.output._last_text_len = len(self.output.text)
        self.output._last_token_ids_len = len(self.output.token_ids)
        self.output._last_logprobs_len = len(self.output.logprobs)

    def add_tokens(
        self,
        new_ids: list[int],
        text_ids: list[int] | None = None,
        logprobs: Sequence[Any] | None = None,
    ) -> bool:
        """Append tokens and refresh the text from `text_ids` (default: the same tokens);
        `logprobs`: the engine's entry of each new token.

        Returns True when a stop string was found (the completion is then finished).
        """
        if self.output.finished:
            return False
        self.output.token_ids.extend(new_ids)
        if logprobs is not None:
            out = self.output
            out.logprobs.extend(to_token_logprobs(new_ids, logprobs))
            added = sum(entry.logprob for entry in logprobs)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + added
        if self._detok is None:
            return False
        if self._lazy:
            self._detok.append(new_ids if text_ids is None else text_ids)
            return False
        self._detok.add(new_ids if text_ids is None else text_ids)
        return self._refresh_text(self._detok.text, final=False)

    def finish(self, finish_reason: str, stop_reason: int | str | None = None) -> None:
        """Finish (no-op when already finished, e.g. by a stop string found here)."""
        if self.output.finished:
            return
        if self._detok is not None and self._refresh_text(self._detok.finish(), final=True):
            return
        self.output.finish_reason = finish_reason
        self.output.stop_reason = stop_reason

    def _refresh_text(self, text: str, final: bool) -> bool:
        if len(self.output.token_ids) <= self._min_tokens:
            self._stops_from = len(text)
        hit = self._find_stop(text, 0 if final else max(self._searched - self._holdback, 0))
        self._searched = len(text)
        if hit is not None:
            cut, stop_str = hit
            self.output.text = text[:cut]
            self.output.finish_reason = "stop"
            self.output.stop_reason = stop_str
            return True
        visible = len(text) if final else len(text) - self._holdback
        # Never shrink text already shown (a re-decode can only extend a stable prefix).
        self.output.text = text[: max(visible, len(self.output.text))]
        return False

    def _find_stop(self, text: str, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop_str in self._stop:
            pos = text.find(stop_str, max(start, self._stops_from - len(stop_str) + 1))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop_str)
        if best is None:
            return None
        pos, stop_str = best
        return (pos + len(stop_str) if self._include_stop else pos), stop_str
