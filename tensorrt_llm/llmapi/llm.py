"""LLM: the user-facing entry point (`tensorrt_llm.LLM`).

`LLM(model_dir, ...)` validates its knobs (`LlmArgs`), loads the tokenizer and the input
processor of the checkpoint, and starts a `PyExecutor` (model, capacity probe, KV cache, loop).
`generate` blocks; `generate_async` returns a `GenerationResult` handle (awaitable, streamable).

Bad input fails only its own request: everything checkable on the host (prompt form, media,
placeholders, `limit_mm_per_prompt`, prompt length, token ids) raises ValueError from
`generate`/`generate_async` before anything reaches the executor. A batch `generate` checks
every input first and raises for the first bad one without submitting any. Failures inside
the executor come back as `RequestOutput.error` and leave the engine serving.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from .._torch.pyexecutor.llm_request import LlmRequest
from ..inputs.registry import create_input_processor, load_tokenizer
from ..sampling_params import SamplingParams
from .errors import InvalidSamplingParamError, PromptTooLongError
from .generation_defaults import GenerationDefaults
from .input_preparer import InputPreparer, PreparedRequest
from .llm_args import LlmArgs
from .result import GenerationResult

logger = logging.getLogger(__name__)

_SEED_MOD = 2**64


def _is_chat(inputs: Any) -> bool:
    """A list of {role, content} dicts is one conversation, not a batch."""
    return (
        isinstance(inputs, list)
        and bool(inputs)
        and all(isinstance(m, dict) and "role" in m for m in inputs)
    )


def _wait_all(results: list[GenerationResult], on_finished: Callable[[int], Any]) -> None:
    """Wait for every result, applying each one's responses as they arrive (not in turn).

    NOTE: stop strings are found where responses are applied; waiting on the results one by
    one would leave a later request generating past its stop string until its turn came.
    """
    event = threading.Event()
    for result in results:
        result.listener = event
    running = list(results)
    while running:
        event.clear()  # before applying: a response arriving from here on sets it again
        for result in running:
            result._process()
        still = [r for r in running if not r.finished]
        if len(still) < len(running):
            on_finished(len(running) - len(still))
        running = still
        if running:
            event.wait(1.0)


def _serve_as_torchrun_worker(args: LlmArgs) -> None:
    """Under torchrun (RANK, WORLD_SIZE, LOCAL_RANK set, tensor_parallel_size = WORLD_SIZE),
    ranks 1.. do not serve: they run rank 0's steps until it stops, then end the process, so
    one script (or trtllm-serve) is the entry point of every rank. Rank 0 goes on as usual."""
    from ..executor.torchrun import run_torchrun_worker, torchrun_job

    job = torchrun_job(args.tensor_parallel_size)
    if job is None or job.rank == 0:
        return
    run_torchrun_worker(args, job)
    raise SystemExit(0)


class LLM:
    """Generate text from a local Qwen(-VL) checkpoint folder.

    Keyword arguments are the fields of `LlmArgs` (unknown names raise ValueError).
    """

    def __init__(self, model: str, tokenizer: str | None = None, **kwargs: Any) -> None:
        self._executor: Any = None  # None once shut down
        self._final_stats_source: Any = None
        self._is_shutdown = False
        self.args = LlmArgs.from_kwargs(model=model, tokenizer=tokenizer, **kwargs)
        _serve_as_torchrun_worker(self.args)  # ranks 1.. of a torchrun job end here
        if self.args.seed is not None:
            torch.manual_seed(self.args.seed)
        # Read (and checked) before the engine starts: a bad file fails in seconds, not after
        # the model loads; logged once here (preprocess workers read theirs silently).
        self.generation_defaults = GenerationDefaults.from_checkpoint(
            self.args.model, self.args.generation_config
        )
        self.generation_defaults.log_startup()
        self._tokenizer = load_tokenizer(
            self.args.tokenizer or self.args.model, self.args.trust_remote_code
        )
        self.input_processor = create_input_processor(
            self.args.model,
            tokenizer=self._tokenizer,
            trust_remote_code=self.args.trust_remote_code,
        )
        if self.args.executor_mode == "process":
            # The engine builds and runs in a child process; this process keeps the
            # tokenizer and the input processor (it never loads the model).
            from ..executor.proxy import GenerationExecutorProxy

            self._executor = GenerationExecutorProxy(self.args)
        else:
            # Imported here: building the executor pulls in the model code.
            from .._torch.pyexecutor.py_executor_creator import create_py_executor

            self._executor = create_py_executor(self.args.to_engine_config(), self.input_processor)
        # The engine's final value (its default is capped by the KV cache at startup).
        self._max_seq_len: int = self._executor.max_seq_len
        self._preparer = InputPreparer(
            self.args,
            self._tokenizer,
            self.input_processor,
            self._max_seq_len,
            self.generation_defaults,
        )
        self._ids = itertools.count()
        self._ids_lock = threading.Lock()

    # ---- properties ----------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def is_shutdown(self) -> bool:
        return self._is_shutdown

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    def get_stats(self) -> Any:
        """Executor stats (running/waiting requests, KV usage, free seq slots, ...)."""
        executor = self._executor or self._final_stats_source
        return executor.get_stats()

    # ---- generation ----------------------------------------------------------------------------
    def generate(
        self,
        inputs: Any,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate for one input or a list of inputs; blocks until all are finished.

        An input is a string, a TextPrompt/TokensPrompt dict, or chat messages (a list of
        {role, content} dicts). A list of inputs returns a list of outputs, in order.
        """
        is_batch = isinstance(inputs, list) and not _is_chat(inputs)
        items = list(inputs) if is_batch else [inputs]
        params = self._params_per_item(sampling_params, len(items))
        prepared = []
        for i, (item, sp) in enumerate(zip(items, params, strict=True)):
            try:
                prepared.append(self.prepare(item, sp))
            except (ValueError, TypeError) as exc:
                # The input's index added; a PromptTooLongError (or TypeError) stays one.
                cls = type(exc) if isinstance(exc, PromptTooLongError | TypeError) else ValueError
                raise cls(f"input {i}: {exc}" if is_batch else str(exc)) from exc
        results = [self._submit(p, streaming=False) for p in prepared]
        show = use_tqdm and is_batch and len(results) > 1
        with tqdm(total=len(results), desc="Processed prompts", disable=not show) as bar:
            _wait_all(results, bar.update)
        return results if is_batch else results[0]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """The assistant's reply to a conversation (a list of {role, content} dicts), or to
        each of a list of conversations, through the chat template; `chat_template_kwargs`
        are template variables (e.g. {"enable_thinking": False} for Qwen3 / Qwen3.5 / 3.6).
        """
        batch = isinstance(messages, list) and bool(messages) and isinstance(messages[0], list)
        conversations = messages if batch else [messages]
        extra = {"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {}
        prompts = [{"prompt": conversation, **extra} for conversation in conversations]
        return self.generate(prompts if batch else prompts[0], sampling_params, use_tqdm)

    def generate_async(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        streaming: bool = False,
        scheduling_group: Hashable | None = None,
    ) -> GenerationResult:
        """Submit one input and return its handle at once.

        `await handle` (or `handle.result()`) gives the final output; with streaming,
        `async for out in handle` yields snapshots whose `outputs[i].text_diff` is the delta.
        `scheduling_group`: inputs that share it are admitted round-robin against other groups
        (the server gives all prompts of one HTTP request one group); by default each input
        is its own group.
        """
        prepared = self.prepare(inputs, sampling_params)
        return self._submit(prepared, streaming=streaming, scheduling_group=scheduling_group)

    def _params_per_item(
        self, sampling_params: SamplingParams | list[SamplingParams] | None, n: int
    ) -> list[SamplingParams | None]:
        if isinstance(sampling_params, list):
            if len(sampling_params) != n:
                raise ValueError(
                    f"got {len(sampling_params)} sampling_params for {n} inputs; give one, or "
                    "one per input"
                )
            return list(sampling_params)
        return [sampling_params] * n

    # ---- the engine-client interface (engine_client.py): what trtllm-serve uses --------------
    def prepare(
        self,
        inputs: Any,
        sampling_params: SamplingParams | None = None,
        fit_max_tokens: bool = False,
    ) -> PreparedRequest:
        """Process one input on the host and run the engine's checks; raises ValueError /
        TypeError (PromptTooLongError included) for bad input. See `finalize` for
        `fit_max_tokens`."""
        self._live_executor()  # fail fast, before any input processing
        return self.finalize(self._preparer.prepare(inputs, sampling_params), fit_max_tokens)

    def finalize(self, prepared: PreparedRequest, fit_max_tokens: bool = False) -> PreparedRequest:
        """The engine's checks on a request prepared here or by an `InputPreparer` elsewhere
        (a preprocess worker). fit_max_tokens: the request's max_tokens is a default, not the
        caller's: cut it to what max_seq_len leaves after the prompt (vision tokens included,
        so only known now), at least 1."""
        sp = prepared.sampling_params
        if fit_max_tokens:
            room = self._max_seq_len - len(prepared.prompt_token_ids)
            sp = replace(sp, max_tokens=max(1, min(sp.max_tokens, room)))
        self._check_request(prepared.prompt_token_ids, sp)
        return replace(prepared, sampling_params=sp)

    def submit(
        self,
        prepared: PreparedRequest,
        streaming: bool = False,
        scheduling_group: Hashable | None = None,
    ) -> GenerationResult:
        """Hand a finalized request to the engine; its handle at once."""
        return self._submit(prepared, streaming=streaming, scheduling_group=scheduling_group)

    def preparer_spec(self) -> tuple[LlmArgs, int]:
        """(args, max_seq_len): what an `InputPreparer` in another process is built from."""
        return self.args, self._max_seq_len

    @property
    def engine_alive(self) -> bool:
        """False once the engine stopped by itself (e.g. its process died); True after a
        deliberate shutdown()."""
        executor = self._executor
        return executor is None or bool(getattr(executor, "is_alive", True))

    # ---- host-side preparation -----------------------------------------------------------------
    def _with_end_ids(self, sp: SamplingParams) -> SamplingParams:
        return self._preparer.with_end_ids(sp)

    def _check_request(self, ids: list[int], sp: SamplingParams) -> None:
        """The executor's own checks, run here so a bad input raises in the caller."""
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        executor = self._live_executor()
        # The process-mode proxy reports the engine's vocab_size; PyExecutor has its parts.
        vocab = getattr(executor, "vocab_size", 0) or (
            getattr(executor.model_engine, "vocab_size", 0)
            or getattr(executor.sampler, "vocab_size", 0)
        )
        if vocab and (max(ids) >= vocab or min(ids) < 0):
            raise ValueError(
                f"prompt token ids must lie in [0, {vocab}), got {min(ids)}..{max(ids)}"
            )
        invalid = sp.vocab_problem(vocab) if vocab else None
        if invalid is not None:
            raise InvalidSamplingParamError(invalid[1], param=invalid[0])
        error = executor.why_never_fits(LlmRequest(-1, ids, sp))
        if error is not None:
            raise PromptTooLongError(error)

    # ---- submission ----------------------------------------------------------------------------
    def _next_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    def _live_executor(self) -> Any:
        executor = self._executor
        if executor is None or self._is_shutdown:
            raise RuntimeError("the LLM is shut down")
        return executor

    def _submit(
        self,
        prepared: PreparedRequest,
        streaming: bool,
        scheduling_group: Hashable | None = None,
    ) -> GenerationResult:
        executor = self._live_executor()
        sp = prepared.sampling_params
        child_ids = [self._next_id() for _ in range(sp.n)]
        result = GenerationResult(
            request_id=child_ids[0],
            prompt=prepared.prompt,
            prompt_token_ids=prepared.prompt_token_ids,
            sampling_params=sp,
            tokenizer=self._tokenizer,
            child_request_ids=child_ids,
            abort_fn=executor.cancel_request,
            streaming=streaming,
        )
        for i, rid in enumerate(child_ids):
            child_sp = sp if sp.n == 1 else self._child_params(sp, i)
            mm = prepared.multimodal_params
            if mm is not None and i > 0:
                mm = copy.deepcopy(mm)  # the executor moves and strips each request's own copy
            request = LlmRequest(rid, prepared.prompt_token_ids, child_sp, mm)
            request.cache_salt = prepared.cache_salt
            # The n completions of one input share a group unless the caller gave one.
            request.scheduling_group = (
                ("llm", child_ids[0]) if scheduling_group is None else scheduling_group
            )
            executor.enqueue_request(request, result._on_response)
        return result

    @staticmethod
    def _child_params(sp: SamplingParams, index: int) -> SamplingParams:
        """Completion `index` of an n > 1 request: its own seed, so samples differ; only the
        first computes the prompt logprobs (the same prompt: the others would repeat them)."""
        seed = None if sp.seed is None else (sp.seed + index) % _SEED_MOD
        prompt_logprobs = sp.prompt_logprobs if index == 0 else None
        return replace(sp, n=1, seed=seed, prompt_logprobs=prompt_logprobs)

    # ---- lifetime ------------------------------------------------------------------------------
    def shutdown(self, wait: bool = False) -> None:
        """Stop the executor. In-flight requests fail (or finish first with wait=True).

        Idempotent; `get_stats()` keeps working afterwards (final counts)."""
        self._is_shutdown = True
        executor, self._executor = self._executor, None
        if executor is not None:
            self._final_stats_source = executor
            executor.shutdown(wait=wait)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: best effort only
            pass
