"""LogitProcessors: the logit edits that come before temperature, batched over requests.

In vLLM/HF order, on a float32 copy of the step's logits on their device: `logit_bias` (added),
bad words and `min_tokens` (banned: -inf), then the repetition penalty and the presence /
frequency penalties on those raw logits. Temperature, min_p, top-k and top-p follow in the
sampler. Rows of requests without a feature get neutral values (or no index at all), so one
set of kernels serves a batch that mixes settings. Per-row knobs and index lists go up through
pinned staging with non_blocking copies: no host sync. Penalties and multi-token bad words read
the device-side `TokenHistory`, which `record` advances from the sampled tokens.

Definitions (what the tests check against):
- repetition_penalty (HF `RepetitionPenaltyLogitsProcessor`, vLLM): over prompt + output, a
  seen token's logit is divided by the penalty when > 0 and multiplied by it otherwise;
- presence / frequency (OpenAI, vLLM): over the OUTPUT only, minus presence once for a token
  that occurred, minus frequency times its count;
- bad words (vLLM; HF `NoBadWordsLogitsProcessor` over the output): a sequence's last token is
  banned when the output ends with the rest of it; one-token words are always banned;
- min_tokens: the ids that would stop the request (end id unless ignore_eos, stop_token_ids)
  are banned while fewer than min_tokens tokens were generated (in-flight ones included),
  except in a row the ban would leave without any allowed token (a guided request whose
  grammar can only stop: it ends, short of min_tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..._utils import async_tensor_h2d
from .llm_request import LlmRequest
from .token_history import TokenHistory, is_tracked

_WILDCARD = -2  # left padding of a bad word's prefix: matches any tail entry


@dataclass(frozen=True)
class HistoryUpdate:
    """Which rows of the step's batch go into which TokenHistory rows (device int64 [n])."""

    batch_rows: torch.Tensor
    history_rows: torch.Tensor


def banned_stop_ids(req: LlmRequest) -> list[int]:
    """The stop ids `min_tokens` still bans for `req` at this sample (empty once it may stop)."""
    params = req.sampling_params
    if req.num_sampled_tokens >= params.min_tokens:
        return []
    ids = list(params.stop_token_set)
    if params.end_id is not None and not params.ignore_eos:
        ids.append(params.end_id)
    return ids


class LogitProcessors:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.history = TokenHistory(vocab_size, device)

    def apply(
        self, logits: torch.Tensor, requests: Sequence[LlmRequest]
    ) -> tuple[torch.Tensor, HistoryUpdate | None]:
        """Processed float32 logits [B, V] (a copy), and the history update `record` needs
        after sampling (None when no request of the step is tracked)."""
        out = logits.to(torch.float32, copy=True)
        tracked = [i for i, req in enumerate(requests) if is_tracked(req.sampling_params)]
        history_rows = self.history.rows([requests[i] for i in tracked])
        row_of = dict(zip(tracked, history_rows, strict=True))
        self._add_bias(out, requests)
        self._ban_tokens(out, requests)
        self._ban_bad_word_ends(out, requests, row_of)
        self._penalize(out, requests, row_of)
        if not tracked:
            return out, None
        rows = async_tensor_h2d([tracked, history_rows], torch.int64, out.device)
        return out, HistoryUpdate(rows[0], rows[1])

    def record(self, update: HistoryUpdate, tokens: torch.Tensor) -> None:
        """Put the step's sampled tokens [B] into the history of the tracked rows."""
        self.history.record(update.history_rows, tokens.index_select(0, update.batch_rows))

    def release(self, request_id: int) -> None:
        self.history.release(request_id)

    # ---- the processors ------------------------------------------------------------------------
    @staticmethod
    def _add_bias(out: torch.Tensor, requests: Sequence[LlmRequest]) -> None:
        rows: list[int] = []
        toks: list[int] = []
        vals: list[float] = []
        for i, req in enumerate(requests):
            for tok, bias in (req.sampling_params.logit_bias or {}).items():
                rows.append(i)
                toks.append(tok)
                vals.append(float(bias))
        if not rows:
            return
        index = async_tensor_h2d([rows, toks], torch.int64, out.device)
        values = async_tensor_h2d(vals, torch.float32, out.device)
        out.index_put_((index[0], index[1]), values, accumulate=True)

    @staticmethod
    def _ban_tokens(out: torch.Tensor, requests: Sequence[LlmRequest]) -> None:
        """One-token bad words, then the stop ids min_tokens still bans."""
        words: tuple[list[int], list[int]] = ([], [])
        stops: tuple[list[int], list[int]] = ([], [])
        for i, req in enumerate(requests):
            for seq in req.sampling_params.bad_words_token_ids or ():
                if len(seq) == 1:
                    words[0].append(i)
                    words[1].append(seq[0])
            for tok in banned_stop_ids(req):
                stops[0].append(i)
                stops[1].append(tok)
        if words[0]:
            index = async_tensor_h2d(words, torch.int64, out.device)
            # new_full: a fill kernel, not a host scalar copied up.
            out.index_put_((index[0], index[1]), out.new_full((len(words[0]),), float("-inf")))
        if not stops[0]:
            return
        index = async_tensor_h2d(stops, torch.int64, out.device)
        kept = out[index[0], index[1]]
        out.index_put_((index[0], index[1]), out.new_full((len(stops[0]),), float("-inf")))
        # min_tokens yields where it would leave a row no token at all: a grammar (applied
        # before) that allows nothing but stopping, i.e. a complete structured output, ends
        # the request early instead of failing it. Decided on the device from each row's max
        # (one [B] reduction, no [entries, V] copy).
        dead = torch.isneginf(out.amax(dim=1)).index_select(0, index[0])
        out.index_put_((index[0], index[1]), torch.where(dead, kept, float("-inf")))

    def _ban_bad_word_ends(
        self, out: torch.Tensor, requests: Sequence[LlmRequest], row_of: dict[int, int]
    ) -> None:
        """Multi-token bad words: ban the last token where the output's tail is the prefix."""
        width = self.history.tail_len
        entries: list[list[int]] = []  # [batch row, history row, last token, prefix (width)]
        for i, req in enumerate(requests):
            for seq in req.sampling_params.bad_words_token_ids or ():
                if len(seq) < 2:
                    continue
                prefix = list(seq[:-1])
                pad = [_WILDCARD] * (width - len(prefix))
                entries.append([i, row_of[i], seq[-1], *pad, *prefix])
        if not entries:
            return
        tail = self.history.tail
        assert tail is not None  # a multi-token bad word took a row, which sized the tail
        table = async_tensor_h2d(entries, torch.int64, out.device)
        prefixes = table[:, 3:]
        recent = tail.index_select(0, table[:, 1])
        match = ((recent == prefixes) | (prefixes == _WILDCARD)).all(dim=1)
        # Added, not assigned: two words may end in the same token of one row, and with
        # duplicate indices only accumulation is well defined (0 where the prefix differs).
        ban = torch.where(match, float("-inf"), 0.0)
        out.index_put_((table[:, 0], table[:, 2]), ban, accumulate=True)

    def _penalize(
        self, out: torch.Tensor, requests: Sequence[LlmRequest], row_of: dict[int, int]
    ) -> None:
        rows: list[int] = []
        hist: list[int] = []
        knobs: list[list[float]] = [[], [], []]  # repetition, presence, frequency
        for i, req in enumerate(requests):
            params = req.sampling_params
            if not params.uses_penalties:
                continue
            rows.append(i)
            hist.append(row_of[i])
            knobs[0].append(float(params.repetition_penalty))
            knobs[1].append(float(params.presence_penalty))
            knobs[2].append(float(params.frequency_penalty))
        if not rows:
            return
        codes_all = self.history.codes
        assert codes_all is not None  # a penalised request took a row, which allocated it
        dev = out.device
        index = async_tensor_h2d([rows, hist], torch.int64, dev)
        rep, presence, frequency = async_tensor_h2d(knobs, torch.float32, dev).unsqueeze(2)
        codes = codes_all.index_select(0, index[1])
        counts = torch.bitwise_right_shift(codes, 1)  # output occurrences
        in_output = counts > 0
        seen = codes > 0  # prompt bit or output (the repetition penalty's set)
        sub = out.index_select(0, index[0])
        scale = torch.where(seen, rep, 1.0)
        sub = torch.where(sub > 0, sub / scale, sub * scale)
        sub = sub - frequency * counts - presence * in_output
        out.index_copy_(0, index[0], sub)
