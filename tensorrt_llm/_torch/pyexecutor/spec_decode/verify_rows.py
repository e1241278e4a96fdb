"""A speculative step's verify rows (a generation request's last token and its drafts) and
the host results of the rows that check its drafts (spec_decoder.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .acceptance import wants_drafts

if TYPE_CHECKING:
    from ..llm_request import LlmRequest


@dataclass
class VerifyRow:
    """One generation row of the step: its drafts and where its tokens sit."""

    request: LlmRequest
    drafts: list[int]
    start: int  # KV position of its input token
    token: int  # its input token (the last one on the host)
    offset: int = 0  # first row in the step's hidden states
    emitted: list[int] = field(default_factory=list)


@dataclass
class DraftChecks:
    """Host results of the draft-checking rows, indexed by check row (verify order)."""

    greedy: list[int] = field(default_factory=list)
    accepted: dict[int, bool] = field(default_factory=dict)  # sampled requests' rows only
    residual: dict[int, int] = field(default_factory=dict)


def check_rows(verify: list[VerifyRow]) -> list[int]:
    """The hidden-state rows whose logits check the drafts, in verify order."""
    return [v.offset + j for v in verify for j in range(len(v.drafts))]


def unpack_checks(host: list[int], verify: list[VerifyRow]) -> DraftChecks:
    """`SpecDecoder._checks`' tensor, on the host, back into its parts."""
    owners = [v.request for v in verify for _ in v.drafts]
    picked = [i for i, req in enumerate(owners) if not wants_drafts(req)]
    n = len(owners)
    accepted = (bool(a) for a in host[n : n + len(picked)])
    return DraftChecks(
        greedy=host[:n],
        accepted=dict(zip(picked, accepted, strict=True)),
        residual=dict(zip(picked, host[n + len(picked) :], strict=True)),
    )
