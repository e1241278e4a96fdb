"""The engine-client interface: what a front end (trtllm-serve) needs from an engine.

`LLM` implements it; the server (serve/llm_client.py) uses nothing else of the LLM, so the engine
behind it can live in this process or another (`executor_mode`) without the server changing.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, Protocol, runtime_checkable

from ..sampling_params import SamplingParams
from .input_preparer import PreparedRequest
from .llm_args import LlmArgs


@runtime_checkable
class EngineClient(Protocol):
    """Submit, abort (through the returned handle's `abort()`), stream outputs (the handle is
    an async iterator), stats, and the limits a front end applies before submitting."""

    @property
    def max_seq_len(self) -> int: ...

    @property
    def engine_alive(self) -> bool: ...

    @property
    def is_shutdown(self) -> bool: ...

    def prepare(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        fit_max_tokens: bool = False,
    ) -> PreparedRequest: ...

    def finalize(
        self, prepared: PreparedRequest, fit_max_tokens: bool = False
    ) -> PreparedRequest: ...

    def submit(
        self,
        prepared: PreparedRequest,
        streaming: bool = False,
        scheduling_group: Hashable | None = None,
    ) -> Any: ...

    def preparer_spec(self) -> tuple[LlmArgs, int]: ...

    def get_stats(self) -> Any: ...

    def shutdown(self) -> None: ...
