"""GuidedDecoder: the engine side of structured output (one xgrammar matcher per request).

Life of a guided request in the engine (all on the loop thread unless said otherwise):
1. `admit` (validation): its grammar starts compiling in a worker thread, never on the loop;
   the first guided request also builds the TokenizerInfo (model vocab size) and the cached
   `GrammarCompiler` there.
2. `prepare` (before the step's forward): a request about to sample its first token waits for
   its compiled grammar (prefill usually hid the compile) and gets its `GrammarMatcher`; a
   grammar that failed is a RequestInputError, which fails that request alone.
3. `mask_logits` (after the forward, before sampling): the matchers fill a host bitmask, one
   non_blocking H2D from pinned memory, and the disallowed columns of those rows become -inf.
   Padding columns past the tokenizer's vocab are never allowed.
4. `advance` (once the step's tokens are on the host): each matcher accepts the request's new
   tokens; a matcher that terminated finishes its request with "stop".

A step without guided requests does none of this: every hook returns at once while no guided
request is live (`active`). The overlap executor needs a matcher to have seen the previous token
before the next mask is built; `needs_sync` tells it to accept that step's tokens between the
next forward and its sampling. A request that finished meanwhile (its token is dropped) gets
no mask.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._utils import async_tensor_h2d
from ..input_errors import RequestInputError
from .grammar_compile import MISSING_XGRAMMAR, compile_source, import_xgrammar
from .llm_request import ERROR_INVALID_INPUT, LlmRequest
from .scheduler import ScheduledRequests

logger = logging.getLogger(__name__)

_BITS = 32  # xgrammar's bitmask: int32 words, token i is bit i % 32 of word i // 32


@dataclass
class _GuidedState:
    compiled: Future[Any]
    matcher: Any = None  # xgrammar.GrammarMatcher, made when the request first samples
    num_accepted: int = 0  # output tokens the matcher has seen
    stop_ids: list[int] = field(default_factory=list)


def _stop_ids(req: LlmRequest) -> list[int]:
    """The tokens that end the request: the grammar allows them only where it may end."""
    params = req.sampling_params
    ids = [] if params.ignore_eos or params.end_id is None else [params.end_id]
    ids.extend(t for t in params.stop_token_ids or () if t not in ids)
    return ids


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int, width: int) -> torch.Tensor:
    """bool [R, width] from xgrammar's int32 [R, ceil(vocab/32)] bitmask; columns past
    `vocab_size` (logits padding) are False."""
    shifts = torch.arange(_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # arithmetic shift: & 1 still reads bit k
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
    if width > vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, width - vocab_size), value=False)
    return allowed


def admit_guided(decoder: GuidedDecoder | None, req: LlmRequest) -> str | None:
    """Why the engine cannot serve `req`'s guided decoding, or None (also when unguided)."""
    if req.sampling_params.guided_decoding is None:
        return None
    if decoder is None:
        return "guided decoding is not available in this engine (no guided decoder)"
    return decoder.admit(req)


class GuidedDecoder:
    """Per-request grammar matchers of one engine; built cheaply, xgrammar loaded on first use.

    `tokenizer` is the checkpoint's HF tokenizer, `vocab_size` the model's (logits may be
    wider than the tokenizer's vocab).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_compile_threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._states: dict[int, _GuidedState] = {}  # loop thread only
        self._pool: ThreadPoolExecutor | None = None
        self._max_threads = max_compile_threads
        self._compiler: Any = None
        self._compiler_lock = threading.Lock()  # the compile threads build it once

    @property
    def active(self) -> bool:
        """True while any guided request is live; every hook is a no-op otherwise."""
        return bool(self._states)

    # ---- admission and compilation -------------------------------------------------------------
    def admit(self, req: LlmRequest) -> str | None:
        """Start compiling `req`'s grammar; the reason it cannot be served, or None."""
        params = req.sampling_params.guided_decoding
        if params is None:
            return None
        if self.tokenizer is None:
            return "guided decoding needs the checkpoint's tokenizer, and this engine has none"
        try:
            import_xgrammar()
        except ImportError:
            return MISSING_XGRAMMAR
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._max_threads, thread_name_prefix="grammar")
        future = self._pool.submit(self._compile, params.grammar_source())
        self._states[req.request_id] = _GuidedState(future, stop_ids=_stop_ids(req))
        return None

    def _compile(self, source: Any) -> Any:  # on a compile thread
        return compile_source(self._get_compiler(), source)

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                xgr = import_xgrammar()
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size
                )
                # cache_enabled: equal sources (schema text, regex, EBNF) compile once.
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
            return self._compiler

    def prepare(self, scheduled: ScheduledRequests) -> None:
        """Matchers for the step's requests that sample their first token. Runs before the
        forward: a grammar that failed to compile raises RequestInputError for its request."""
        if not self._states:
            return
        for req in scheduled.all_requests:
            state = self._states.get(req.request_id)
            if state is None or state.matcher is not None:
                continue
            if req.is_context_init and not req.is_last_context_chunk:
                continue  # no token this step: let the compile run on behind the prefill
            try:
                compiled = state.compiled.result()
            except Exception as exc:
                raise RequestInputError([req.request_id], f"guided decoding: {exc}") from exc
            xgr = import_xgrammar()
            state.matcher = xgr.GrammarMatcher(
                compiled,
                override_stop_tokens=state.stop_ids or None,
                # No stop token at all (ignore_eos and no stop ids): end where the grammar does.
                terminate_without_stop_token=not state.stop_ids,
            )

    # ---- per step ------------------------------------------------------------------------------
    def mask_logits(self, logits: torch.Tensor, requests: list[LlmRequest]) -> torch.Tensor:
        """`logits` [B, W] (row i samples `requests[i]`) with every token the grammar forbids
        at -inf in the guided rows; the same tensor when no row is guided."""
        if not self._states:
            return logits
        rows: list[int] = []
        matchers: list[Any] = []
        for i, req in enumerate(requests):
            state = self._states.get(req.request_id)
            if state is None or req.is_finished:  # finished: this row's token is dropped
                continue
            self._check_fresh(req, state)
            rows.append(i)
            matchers.append(state.matcher)
        if not rows:
            return logits
        xgr = import_xgrammar()
        host = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for j, matcher in enumerate(matchers):
            matcher.fill_next_token_bitmask(host, j)
        device = logits.device
        # Pinned staging, non_blocking: the host goes on while the copy runs.
        bitmask = async_tensor_h2d(host, torch.int32, device)
        allowed = unpack_bitmask(bitmask, self.vocab_size, logits.shape[1])
        if len(rows) != logits.shape[0]:
            full = torch.ones(logits.shape, dtype=torch.bool, device=device)
            full.index_copy_(0, async_tensor_h2d(rows, torch.int64, device), allowed)
            allowed = full
        # Out of place: the logits may be a CUDA graph's output buffer or an inference tensor.
        return logits.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def _check_fresh(req: LlmRequest, state: _GuidedState) -> None:
        """Never build a mask from a matcher that has not seen every token of its request."""
        if state.matcher is None:
            raise RuntimeError(f"request {req.request_id}: guided matcher not prepared")
        if req.num_in_flight_tokens or state.num_accepted != req.num_generated_tokens:
            raise RuntimeError(
                f"request {req.request_id}: its guided mask would be stale "
                f"({req.num_in_flight_tokens} tokens in flight)"
            )

    def advance(self, requests: list[LlmRequest]) -> None:
        """Feed each guided request's new host tokens to its matcher; finish ("stop") those
        whose grammar terminated, fail those whose token the grammar refused."""
        if not self._states:
            return
        for req in requests:
            state = self._states.get(req.request_id)
            if state is None or state.matcher is None:
                continue
            new = req.output_token_ids[state.num_accepted :]
            for token in new:
                if state.matcher.is_terminated():
                    break  # the stop token was its last; nothing follows
                if not state.matcher.accept_token(token):
                    # Only a grammar that allows no token of this vocab gets here.
                    if not req.is_finished:
                        req.set_error(
                            f"guided decoding: the grammar refused token {token}",
                            ERROR_INVALID_INPUT,
                        )
                    break
            state.num_accepted = req.num_generated_tokens
            if state.matcher.is_terminated() and not req.is_finished:
                req.finish("stop")

    def needs_sync(self, requests: list[LlmRequest]) -> bool:
        """True when one of `requests` (a launched step) is guided and still running: its
        next mask needs that step's token accepted first."""
        if not self._states:
            return False
        return any(r.request_id in self._states and not r.is_finished for r in requests)

    def release(self, request_id: int) -> None:
        """Forget a finished request (its compile, if still running, completes unused)."""
        state = self._states.pop(request_id, None)
        if state is not None:
            state.compiled.cancel()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
