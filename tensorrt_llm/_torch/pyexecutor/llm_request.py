"""LlmRequest: one request's host-side state as it moves through the executor.

Lifecycle: CONTEXT_INIT (prompt being prefilled, possibly over several chunks) ->
GENERATION_IN_PROGRESS (one token per step) -> GENERATION_COMPLETE (finish_reason set).
Preemption by recompute (`preempt`, the scheduler's) sends a request back to CONTEXT_INIT: its
context becomes prompt + the tokens generated so far (`context_len`, `context_token_array`),
prefilled again from position 0; the prompt and `output_token_ids` themselves never change, so
penalties, logprobs, streaming and the seeded generator carry on as if nothing happened.
The scheduler writes `context_chunk_size` and `seq_slot`; after the forward the executor
advances `context_current_position` and applies the sampled tokens (`request_lifecycle.py`).
`output_token_ids` holds real tokens only: a token the overlap scheduler launched the next step
from before it reached the host is counted in `num_in_flight_tokens`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ...sampling_params import SamplingParams

if TYPE_CHECKING:
    from ...inputs.multimodal import MultimodalParams

FINISH_REASONS = ("stop", "length", "cancelled", "error")
# Why a request finished with "error", so callers (trtllm-serve) never parse message text:
# the request can never fit this engine (a client error), its own input could not run (a
# client error found inside the engine step; the other requests of the step ran on), the
# executor was shutting down, or the engine failed.
ERROR_PROMPT_TOO_LONG = "prompt_too_long"
ERROR_INVALID_INPUT = "invalid_input"
ERROR_SHUTTING_DOWN = "shutting_down"
ERROR_ENGINE = "engine_error"
ERROR_CODES = (ERROR_PROMPT_TOO_LONG, ERROR_INVALID_INPUT, ERROR_SHUTTING_DOWN, ERROR_ENGINE)


# Tags the default group key, so it never equals a caller's group value.
_OWN_GROUP = object()


class LlmRequestState(enum.Enum):
    CONTEXT_INIT = enum.auto()
    GENERATION_IN_PROGRESS = enum.auto()
    GENERATION_COMPLETE = enum.auto()


class LlmRequest:
    """Host state of one request. Plain attributes; nothing here touches a device."""

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        multimodal_params: MultimodalParams | None = None,
        arrival_time: float | None = None,
        scheduling_group: Hashable | None = None,
    ) -> None:
        prompt = np.asarray(prompt_token_ids)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError("prompt_token_ids must be a non-empty 1-D sequence of token ids")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise ValueError(f"prompt_token_ids must hold ints, got dtype {prompt.dtype}")
        if int(prompt.min()) < 0:
            raise ValueError("prompt_token_ids must be non-negative")
        self.request_id = request_id
        # NOTE: the prompt never changes after construction; the numpy copy backs the
        # cumulative counts and fast slicing, the list serves Python consumers.
        self._prompt_array: np.ndarray = prompt.astype(np.int64, copy=True)
        self._prompt_array.flags.writeable = False
        self.prompt_token_ids: list[int] = self._prompt_array.tolist()
        self.sampling_params = sampling_params if sampling_params is not None else SamplingParams()
        self.multimodal_params = multimodal_params
        # Requests that share a group (e.g. the prompts x n of one client call) are admitted
        # round-robin against other groups (scheduler.py); None: a group of its own.
        self.scheduling_group = scheduling_group

        self.state = LlmRequestState.CONTEXT_INIT
        self.seq_slot: int | None = None
        self.context_current_position = 0  # prompt tokens already prefilled (in the KV cache)
        self.context_chunk_size = 0  # context tokens scheduled for the current step
        # Hybrid prefix caching: (context position, scratch seq slot) where this step's chunk
        # also snapshots the recurrent state, strictly inside the chunk (hybrid_kv_cache_reuse).
        self.inner_snapshot: tuple[int, int] | None = None
        # Tokens the context phase prefills: the prompt, plus the generated tokens of a
        # preempted request (they are recomputed, not sampled again).
        self._context_len = self.prompt_len
        self._context_tokens: np.ndarray | None = None  # prompt + outputs, once preempted
        self.num_preemptions = 0
        self.output_token_ids: list[int] = []
        # One entry per output token (sampler_logprobs.SampledLogprobs) when the request asks
        # for logprobs, appended with the token (request_lifecycle.apply_new_tokens).
        self.output_logprobs: list[Any] = []
        # With SamplingParams.prompt_logprobs: one entry per prompt position >= 1, appended
        # chunk by chunk (prompt_logprobs.py); sent once, with the first response after.
        self.prompt_logprobs: list[Any] = []
        self._prompt_logprobs_sent = False
        # Sampled on the device, value not on the host yet (overlap scheduler): they count in
        # positions and lengths, and the next step reads them from the SlotState token pool.
        self.num_in_flight_tokens = 0
        self.finish_reason: str | None = None
        # Why a "stop" finish happened: the token id (end_id or a stop token).
        self.stop_reason: int | None = None
        self.error: str | None = None
        self.error_code: str | None = None  # one of ERROR_CODES once `error` is set
        # KV block reuse (kv_cache_reuse.py): the keys of its full blocks so far, its media
        # runs with their hashes (None: not looked at yet), whether it takes no part in reuse,
        # and the prompt tokens its first admission found cached (`num_cached_tokens`, vLLM's
        # name, reported with the final response).
        self.block_keys: list[bytes] = []
        # Mixed into the root of the keys: only requests of the same salt share blocks.
        self.cache_salt: str | None = None
        self.reuse_media_spans: list[Any] | None = None
        self.block_reuse_off = False
        self.num_cached_tokens = 0
        # Where this admission's prefill starts: the end of the cached prefix it hit, else 0.
        self.kv_start_position = 0

        # time.perf_counter() stamps, for TTFT / ITL / latency metrics and `RequestMetrics`.
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.accepted_time: float | None = None  # the executor loop took it in
        self.first_scheduled_time: float | None = None  # its first prompt chunk was scheduled
        self.num_context_steps = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finish_time: float | None = None
        self._cumsum_cache: dict[int, np.ndarray] = {}

    def __repr__(self) -> str:
        return (
            f"LlmRequest(id={self.request_id}, state={self.state.name},"
            f" prompt_len={self.prompt_len}, ctx_pos={self.context_current_position},"
            f" generated={len(self.output_token_ids)}, finish_reason={self.finish_reason})"
        )

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def prompt_len(self) -> int:
        return self._prompt_array.shape[0]

    @property
    def prompt_token_array(self) -> np.ndarray:
        """Read-only int64 view of the prompt, for cheap chunk slicing."""
        return self._prompt_array

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, those still in flight included (positions, KV)."""
        return self.prompt_len + len(self.output_token_ids) + self.num_in_flight_tokens

    @property
    def num_generated_tokens(self) -> int:
        """Generated tokens known on the host."""
        return len(self.output_token_ids)

    @property
    def num_sampled_tokens(self) -> int:
        """Generated tokens, those still in flight included."""
        return len(self.output_token_ids) + self.num_in_flight_tokens

    def logprobs_tail(self, num_tokens: int) -> list[Any] | None:
        """The logprob entries of the last `num_tokens` output tokens (a response's new ones),
        or None when the request did not ask for logprobs."""
        if self.sampling_params.logprobs is None:
            return None
        if num_tokens <= 0:
            return []
        return self.output_logprobs[-num_tokens:]

    def take_prompt_logprobs(self) -> list[Any] | None:
        """The prompt entries once all are in and not sent yet (then marked sent), else
        None (also for requests that did not ask)."""
        if self.sampling_params.prompt_logprobs is None or self._prompt_logprobs_sent:
            return None
        if len(self.prompt_logprobs) < self.prompt_len - 1:
            return None
        self._prompt_logprobs_sent = True
        return self.prompt_logprobs

    @property
    def max_num_tokens(self) -> int:
        """Upper bound on `num_tokens` over the request's life (prompt + max_tokens)."""
        return self.prompt_len + self.sampling_params.max_tokens

    @property
    def context_len(self) -> int:
        """Tokens of the context phase: the prompt, or prompt + outputs after a preemption."""
        return self._context_len

    @property
    def context_token_array(self) -> np.ndarray:
        """Read-only int64 ids of the context phase (chunks slice this)."""
        return self._prompt_array if self._context_tokens is None else self._context_tokens

    @property
    def context_remaining_length(self) -> int:
        """Context tokens not prefilled yet."""
        return self._context_len - self.context_current_position

    @property
    def priority(self) -> int:
        """Scheduling priority (`SamplingParams.priority`): lower runs first, vLLM's way."""
        return self.sampling_params.priority

    @property
    def is_preempted(self) -> bool:
        """Waiting to be recomputed after a preemption (not admitted again yet)."""
        return self.num_preemptions > 0 and self.seq_slot is None and self.is_context_init

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def scheduling_group(self) -> Hashable | None:
        return self._scheduling_group

    @scheduling_group.setter
    def scheduling_group(self, group: Hashable | None) -> None:
        # Checked here, not in the scheduler: an unhashable group there would fail every request.
        try:
            hash(group)
        except TypeError as exc:
            raise TypeError(
                f"scheduling_group must be hashable, got {type(group).__name__}"
            ) from exc
        self._scheduling_group = group

    @property
    def scheduling_key(self) -> Hashable:
        """The admission group: `scheduling_group`, or one of the request's own."""
        if self.scheduling_group is None:
            return (_OWN_GROUP, self.request_id)
        return self.scheduling_group

    # ---- state -------------------------------------------------------------------------------
    @property
    def is_context_init(self) -> bool:
        return self.state is LlmRequestState.CONTEXT_INIT

    @property
    def is_generation(self) -> bool:
        return self.state is LlmRequestState.GENERATION_IN_PROGRESS

    @property
    def is_finished(self) -> bool:
        return self.state is LlmRequestState.GENERATION_COMPLETE

    @property
    def is_first_context_chunk(self) -> bool:
        """The scheduled chunk is the first this admission runs (it starts after any hit)."""
        return self.context_current_position == self.kv_start_position

    @property
    def is_last_context_chunk(self) -> bool:
        """True when the scheduled chunk reaches the context's end (this step samples a token)."""
        return self.context_current_position + self.context_chunk_size >= self._context_len

    def move_to_next_context_chunk(self) -> None:
        """Mark the scheduled chunk as prefilled. Safe to call twice (the chunk resets to 0)."""
        self.context_current_position = min(
            self._context_len, self.context_current_position + self.context_chunk_size
        )
        self.context_chunk_size = 0

    def preempt(self) -> None:
        """Back to CONTEXT_INIT to be recomputed from scratch (the scheduler freed its KV
        blocks and seq slot). The next token it samples is output number
        `num_generated_tokens`, exactly as without the preemption.

        NOTE: a token still in flight could not be recomputed (its value is on the device
        only), so the scheduler never picks such a request.
        """
        if self.is_finished:
            raise ValueError(f"request {self.request_id} is finished; cannot preempt it")
        if self.num_in_flight_tokens:
            raise ValueError(f"request {self.request_id} has a token in flight; cannot preempt")
        self.state = LlmRequestState.CONTEXT_INIT
        self.seq_slot = None
        self.context_current_position = 0
        self.kv_start_position = 0
        self.context_chunk_size = 0
        self._context_len = self.prompt_len + len(self.output_token_ids)
        if self.output_token_ids:
            tokens = np.concatenate(
                [self._prompt_array, np.asarray(self.output_token_ids, dtype=np.int64)]
            )
            tokens.flags.writeable = False
            self._context_tokens = tokens
        self.num_preemptions += 1
        if self.multimodal_params is not None:
            self.multimodal_params.restore_for_recompute()

    def _enter_generation(self) -> None:
        if self.is_context_init:
            self.context_current_position = self._context_len
            self.context_chunk_size = 0
            self.state = LlmRequestState.GENERATION_IN_PROGRESS

    def add_in_flight_token(self) -> None:
        """Count a token sampled on the device whose value the host does not have yet; the
        request is in generation from now on, as with `add_new_token`."""
        if self.is_finished:
            raise ValueError(f"request {self.request_id} is finished; cannot add a token")
        self._enter_generation()
        self.num_in_flight_tokens += 1

    def resolve_in_flight_token(self, token_id: int, now: float | None = None) -> None:
        """The oldest in-flight token reached the host: it becomes a real token."""
        if self.num_in_flight_tokens < 1:
            raise ValueError(f"request {self.request_id} has no token in flight")
        self.num_in_flight_tokens -= 1
        self.add_new_token(token_id, now)

    def add_new_token(self, token_id: int, now: float | None = None) -> None:
        """Append one generated token; a request that just finished its prompt enters generation."""
        if self.is_finished:
            raise ValueError(f"request {self.request_id} is finished; cannot add token {token_id}")
        self._enter_generation()
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.output_token_ids.append(token_id)

    def finish(self, reason: str, now: float | None = None) -> None:
        """Move to GENERATION_COMPLETE with `reason`; a second call keeps the first reason."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        if self.is_finished:
            return
        self.finish_reason = reason
        self.state = LlmRequestState.GENERATION_COMPLETE
        self.finish_time = time.perf_counter() if now is None else now

    def cancel(self) -> None:
        self.finish("cancelled")

    def set_error(self, message: str, code: str = ERROR_ENGINE) -> None:
        if code not in ERROR_CODES:
            raise ValueError(f"error code must be one of {ERROR_CODES}, got {code!r}")
        self.error = message
        self.error_code = code
        self.finish("error")

    # ---- metrics -----------------------------------------------------------------------------
    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def mean_itl(self) -> float | None:
        """Mean seconds between generated tokens (None with fewer than two tokens)."""
        n = len(self.output_token_ids)
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    # ---- prompt token counts -----------------------------------------------------------------
    def _cumsum(self, token_id: int) -> np.ndarray:
        counts = self._cumsum_cache.get(token_id)
        if counts is None:
            # counts[p] = occurrences of token_id in prompt[:p]; computed once per token id.
            counts = np.zeros(self.prompt_len + 1, dtype=np.int64)
            np.cumsum(self._prompt_array == token_id, out=counts[1:])
            self._cumsum_cache[token_id] = counts
        return counts

    def count_tokens_before(self, token_id: int, position: int) -> int:
        """How many times `token_id` occurs in `prompt_token_ids[:position]`."""
        if not 0 <= position <= self.prompt_len:
            raise ValueError(f"position must be in [0, {self.prompt_len}], got {position}")
        return int(self._cumsum(token_id)[position])

    def count_tokens_in_range(self, token_id: int, start: int, end: int) -> int:
        """How many times `token_id` occurs in `prompt_token_ids[start:end]`."""
        if not 0 <= start <= end <= self.prompt_len:
            raise ValueError(f"need 0 <= start <= end <= {self.prompt_len}, got [{start}, {end})")
        counts = self._cumsum(token_id)
        return int(counts[end] - counts[start])
