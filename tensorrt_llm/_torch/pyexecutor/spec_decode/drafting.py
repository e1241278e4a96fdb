"""The drafting half of `SpecDecoder` (spec_decoder.py): which drafts a request verifies in
a step, and after the step's forward the MTP head's next drafts for every request that
drafts, by the eager passes (mtp_drafter.py) or, after a verify-graph step, the draft graphs
(draft_graphs.py). A mixin over the decoder's attributes, so callers keep reading and setting
them on the decoder (`drafts`, `draft_override`, `draft_graphs`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .acceptance import draft_budget, wants_drafts
from .draft_graphs import DraftGraphRunner, DraftRequest
from .mtp_drafter import DraftRow, MTPDrafter
from .rejection import RejectionSampler, wants_sampled_drafts

if TYPE_CHECKING:
    from ..llm_request import LlmRequest
    from ..model_engine import PyTorchModelEngine
    from ..py_executor import PyExecutor
    from .tp_spec import SpecLink
    from .verify_rows import VerifyRow

# (request, the MTP head's drafts) -> the drafts to verify next step (tests); None: the
# head's own.
DraftOverride = Callable[["LlmRequest", list[int]], list[int]]


class Drafting:
    """Drafting for `SpecDecoder`, which sets these attributes."""

    engine: PyTorchModelEngine
    drafter: MTPDrafter
    max_draft_len: int
    drafts: dict[int, list[int]]  # next step's drafts, by request id
    draft_override: DraftOverride | None
    draft_graphs: DraftGraphRunner | None  # the draft passes as CUDA graphs (None: eager)
    rejection: RejectionSampler
    link: SpecLink | None

    def _drafts_for(self, req: LlmRequest) -> list[int]:
        if not takes_drafts(req):
            return []
        return self.drafts.get(req.request_id, [])[: draft_budget(req, self.max_draft_len)]

    def _draft_next(
        self,
        executor: PyExecutor,
        ctx: list[LlmRequest],
        chunks: list[tuple[int, int, bool]],
        offsets: list[int],
        verify: list[VerifyRow],
        hidden: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> None:
        """Run the MTP head over this step's positions and keep each request's next drafts."""
        rows: list[DraftRow] = []
        # `offsets` also holds the verify rows' (after the context requests'): zip stops early.
        for req, (begin, size, last), off in zip(ctx, chunks, offsets, strict=False):
            if req.is_finished or not takes_drafts(req):
                continue
            arr = req.context_token_array
            after = req.output_token_ids[-1] if last else int(arr[begin + size])
            nxt = [*(int(t) for t in arr[begin + 1 : begin + size]), after]
            budget = draft_budget(req, self.max_draft_len) if last else 0
            rows.append(DraftRow(req, off, begin, nxt, budget))
        self._drop_verified(verify)
        for v in verify:
            if v.request.is_finished or not takes_drafts(v.request):
                continue
            budget = draft_budget(v.request, self.max_draft_len)
            rows.append(DraftRow(v.request, v.offset, v.start, v.emitted, budget))
        link = self.link
        drafted = self.drafter.draft(
            rows,
            hidden,
            position_ids,
            send_plan=None if link is None else link.send_draft,
            share=None if link is None else link.share_tokens,
        )
        for row, drafts in zip(rows, drafted, strict=True):
            self._keep_drafts(row.request, drafts, row.num_drafts)

    def _drop_verified(self, verify: list[VerifyRow]) -> None:
        """The verified drafts are spent; a finished request's rejection state goes too."""
        for v in verify:
            self.drafts.pop(v.request.request_id, None)
            if v.request.is_finished:
                self.rejection.release(v.request.request_id)

    def _keep_drafts(self, req: LlmRequest, drafts: list[int], num_drafts: int) -> None:
        """`drafts` (the head's, as many as wanted) become the request's next step's."""
        # NOTE: the override also sees rows with no room for drafts, so a recorder
        # (trtllm-bench's oracle) sees every token but the last.
        if self.draft_override is not None:
            drafts = self.draft_override(req, drafts)[:num_drafts]
        if num_drafts:
            self.drafts[req.request_id] = drafts

    def _graph_drafts(
        self,
        verify: list[VerifyRow],
        tokens_per_request: int,
        hidden: torch.Tensor,
        positions: torch.Tensor,
    ) -> bool:
        """The next drafts of a step of verify rows alone, each of `tokens_per_request` tokens
        (`verify_batch.uniform_verify_len`: 0 when they differ), from the draft graphs
        (draft_graphs.py); False when they do not take the step (the eager passes run)."""
        graphs = self.draft_graphs
        if graphs is None or not graphs.takes(len(verify), tokens_per_request):
            return False
        self._drop_verified(verify)
        requests = [
            DraftRequest(
                v.request, v.start, v.emitted, not v.request.is_finished and takes_drafts(v.request)
            )
            for v in verify
        ]
        drafted = graphs.draft(requests, hidden, positions, self.engine.batch_builder)
        for r, drafts in zip(requests, drafted, strict=True):
            if r.drafting:
                budget = draft_budget(r.request, self.max_draft_len)
                self._keep_drafts(r.request, drafts[:budget], budget)
        return True

    def _forget_finished(self, executor: PyExecutor) -> None:
        """Drop the drafts of requests that left without a last step here (cancelled)."""
        if len(self.drafts) > 2 * self.engine.max_batch_size:
            # Cancelled requests never come back to pop theirs.
            live = {req.request_id for req in executor._active}
            for rid in [rid for rid in self.drafts if rid not in live]:
                self.drafts.pop(rid)
                self.rejection.release(rid)


def takes_drafts(req: LlmRequest) -> bool:
    """Greedy drafting (acceptance by argmax) or sampled drafting (rejection sampling)."""
    return wants_drafts(req) or wants_sampled_drafts(req)
