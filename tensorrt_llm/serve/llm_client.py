"""The server's view of an `LLM`: submission off the event loop, limits, and executor stats.

Everything the server needs from the LLM object goes through `LLMClient`, so the HTTP layer
never reaches into engine internals, and tests can hand the app a fake LLM of the same shape.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from ..llmapi.engine_client import EngineClient
from ..llmapi.errors import InvalidSamplingParamError, PromptTooLongError
from .media_config import MediaError
from .openai_protocol import APIError


class LLMClient:
    """Wraps an `LLM` (or any object with `generate_async`, `tokenizer`, `shutdown`)."""

    def __init__(self, llm: Any, model_name: str | None = None, pool: Any = None) -> None:
        self.llm = llm
        self.model_name = model_name or self._default_name()
        self.pool = pool  # a PreprocessPool, or None: input processing on the server's threads
        # An LLM (the engine-client interface), or a stand-in with generate_async only (tests).
        self._is_engine_client = isinstance(llm, EngineClient)

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
        if not self._is_engine_client:  # a stand-in with generate_async only (tests)
            kwargs = {} if group is None else {"scheduling_group": group}
            return self.llm.generate_async(
                prompt, sampling_params=params, streaming=streaming, **kwargs
            )
        # NOTE: input processing (tokenizing, image preprocessing) runs outside any lock, so
        # one huge prompt never stalls the submissions of other requests.
        prepared = self.llm.prepare(prompt, params, fit_max_tokens=clamp)
        return self.llm.submit(prepared, streaming=streaming, scheduling_group=group)

    def _finish_sync(self, prepared: Any, streaming: bool, clamp: bool, group: Any) -> Any:
        prepared = self.llm.finalize(prepared, fit_max_tokens=clamp)
        return self.llm.submit(prepared, streaming=streaming, scheduling_group=group)

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
            if self.pool is not None and self._is_engine_client:
                prepared = await self.pool.prepare(prompt, params)
                return await asyncio.to_thread(
                    self._finish_sync, prepared, streaming, clamp, scheduling_group
                )
            return await asyncio.to_thread(
                self._submit_sync, prompt, params, streaming, clamp, scheduling_group
            )
        except MediaError as exc:  # decoded in a preprocess worker
            raise APIError(400, str(exc), code=exc.code, param=exc.param) from None
        except InvalidSamplingParamError as exc:
            raise APIError(400, str(exc), code="invalid_sampling_params", param=exc.param) from None
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
    def engine_alive(self) -> bool:
        """False once the engine stopped by itself (e.g. its process died), not when the LLM was
        shut down on purpose."""
        return bool(getattr(self.llm, "engine_alive", True))

    @property
    def is_shut_down(self) -> bool:
        return bool(getattr(self.llm, "is_shutdown", False)) or not self.engine_alive()

    def stats(self) -> Any:
        """The engine's stats (running/waiting, seq slots and KV blocks free and total), or
        None when the LLM has none."""
        get = getattr(self.llm, "get_stats", None)
        return None if get is None else get()

    def shutdown(self) -> None:
        shutdown = getattr(self.llm, "shutdown", None)
        if shutdown is not None:
            shutdown()
