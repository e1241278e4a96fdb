"""The server's view of an `LLM`: submission off the event loop, limits, and executor stats.

Everything the server needs from the LLM object goes through `LLMClient`, so the HTTP layer
never reaches into engine internals, and tests can hand the app a fake LLM of the same shape.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..llmapi.errors import PromptTooLongError
from .openai_protocol import APIError


class LLMClient:
    """Wraps an `LLM` (or any object with `generate_async`, `tokenizer`, `shutdown`)."""

    def __init__(self, llm: Any, model_name: str | None = None, pool: Any = None) -> None:
        self.llm = llm
        self.model_name = model_name or self._default_name()
        self.pool = pool  # a PreprocessPool, or None: input processing on the server's threads

    def _default_name(self) -> str:
        model = getattr(getattr(self.llm, "args", None), "model", None)
        model = model or getattr(self.llm, "model", None) or "model"
        return Path(str(model)).name or str(model)

    # ---- limits --------------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int | None:
        for owner in (self.llm, getattr(self.llm, "args", None)):
            value = getattr(owner, "max_seq_len", None)
            if isinstance(value, int):
                return value
        return None

    @property
    def limit_mm_per_prompt(self) -> dict[str, int] | None:
        args = getattr(self.llm, "args", None)
        return getattr(args, "limit_mm_per_prompt", None) or getattr(
            self.llm, "limit_mm_per_prompt", None
        )

    # ---- submission ----------------------------------------------------------------------------
    def _submit_sync(
        self, prompt: Any, params: Any, streaming: bool, clamp: bool, group: Any
    ) -> Any:
        kwargs = {} if group is None else {"scheduling_group": group}
        if clamp and self._can_clamp():
            # NOTE: input processing (tokenizing, image preprocessing) runs outside any lock,
            # so one huge prompt never stalls the submissions of other requests.
            prepared = self.llm._prepare(prompt, replace(params, max_tokens=1))
            return self._submit_prepared(prepared, params, streaming, clamp, kwargs)
        return self.llm.generate_async(
            prompt, sampling_params=params, streaming=streaming, **kwargs
        )

    def _can_clamp(self) -> bool:
        return all(hasattr(self.llm, n) for n in ("_prepare", "_check_request", "_submit"))

    def _submit_prepared(
        self, prepared: Any, params: Any, streaming: bool, clamp: bool, kwargs: dict[str, Any]
    ) -> Any:
        """Run the LLM's engine-side checks on a prepared request and submit it.

        With `clamp`, max_tokens is cut to what the context leaves after the prompt: the
        prompt length (vision tokens included) is only known after input processing, so the
        request was prepared with max_tokens=1 and the checks run again with the final value.
        NOTE: uses the LLM's private two-phase API until SamplingParams can say "max_tokens=None:
        fill the context" itself.
        """
        final = prepared.sampling_params
        if clamp:
            room = self.llm.max_seq_len - len(prepared.prompt_token_ids)
            final = replace(final, max_tokens=max(1, min(params.max_tokens, room)))
        self.llm._check_request(prepared.prompt_token_ids, final)
        prepared.sampling_params = final
        return self.llm._submit(prepared, streaming=streaming, **kwargs)

    async def _submit_via_pool(
        self, prompt: Any, params: Any, streaming: bool, clamp: bool, group: Any
    ) -> Any:
        assert self.pool is not None
        kwargs = {} if group is None else {"scheduling_group": group}
        first = replace(params, max_tokens=1) if clamp else params
        prepared = await self.pool.prepare(prompt, first)
        return await asyncio.to_thread(
            self._submit_prepared, prepared, params, streaming, clamp, kwargs
        )

    async def submit(
        self,
        prompt: Any,
        params: Any,
        streaming: bool,
        clamp: bool = False,
        scheduling_group: Any = None,
    ) -> Any:
        """Hand one prompt to the LLM; bad input raises APIError(400).

        clamp: params.max_tokens is a default, not the client's; lower it to fit the context.
        scheduling_group: prompts of one HTTP request share it, so the engine admits them
        round-robin against other requests instead of ahead of them all.
        With a preprocess pool the input processing runs in its worker processes.
        """
        try:
            if self.pool is not None and self._can_clamp():
                return await self._submit_via_pool(
                    prompt, params, streaming, clamp, scheduling_group
                )
            return await asyncio.to_thread(
                self._submit_sync, prompt, params, streaming, clamp, scheduling_group
            )
        except (ValueError, TypeError) as exc:
            message = str(exc) or type(exc).__name__
            code = "prompt_too_long" if isinstance(exc, PromptTooLongError) else "invalid_prompt"
            raise APIError(400, message, code=code) from None
        except RuntimeError as exc:
            if self.is_shut_down:
                raise APIError(
                    503, f"server is shutting down: {exc}", code="shutting_down"
                ) from None
            raise

    # ---- health and stats ----------------------------------------------------------------------
    def _executor(self) -> Any:
        for name in ("_executor", "executor", "py_executor", "_py_executor"):
            executor = getattr(self.llm, name, None)
            if executor is not None:
                return executor
        return None

    def engine_alive(self) -> bool:
        """False once the engine stopped by itself (e.g. its process died), not when the LLM was
        shut down on purpose."""
        if bool(getattr(self.llm, "is_shutdown", False)):
            return True
        return getattr(self._executor(), "is_alive", True) is not False

    @property
    def is_shut_down(self) -> bool:
        executor = self._executor()
        alive = getattr(executor, "is_alive", None)
        return alive is False or bool(getattr(self.llm, "is_shutdown", False))

    def stats(self) -> Any:
        """Executor stats plus totals (seq slots, KV blocks), or None when unavailable."""
        get = getattr(self.llm, "get_stats", None)
        executor = self._executor()
        if get is None and executor is not None:
            get = getattr(executor, "get_stats", None)
        if get is None:
            return None
        stats = SimpleNamespace(**vars(get()))
        if executor is not None:
            slots = getattr(executor, "seq_slot_manager", None)
            kv = getattr(executor, "kv_cache_manager", None)
            if getattr(stats, "num_total_seq_slots", None) is None and slots is not None:
                stats.num_total_seq_slots = getattr(slots, "max_num_slots", None)
            if getattr(stats, "num_total_kv_blocks", None) is None and kv is not None:
                stats.num_total_kv_blocks = getattr(kv, "num_blocks", None)
        return stats

    def shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
