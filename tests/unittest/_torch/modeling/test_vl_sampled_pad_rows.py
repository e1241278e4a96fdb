"""Issue 13, defect 1 at the engine level: a generation row whose input token is the image (or
video) pad id shares a step with another request's media prefill.

The merge must place vision embeddings by the context request's placeholder spans only: the
step must not raise, the context request's logits must equal its solo run, and the decoding
request must see its pad token as plain text (its logits equal its own solo decode).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vl_parity_helpers import Stack, admit, build_stack, make_request, our_prefill, prompt, release

from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

ATOL = 1e-5


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_vl"])  # qwen3_vl: deepstack too
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    family = request.param
    ckpt = write_tiny_checkpoint(family, Path(tmp_path_factory.mktemp(family)))
    return build_stack(family, ckpt)


def _pad_id(stack: Stack, kind: str) -> int:
    return stack.processor.image_token_id if kind == "image" else stack.processor.video_token_id


def _decoding_request(stack: Stack, rid: int, token: int) -> LlmRequest:
    """A text request past its prefill whose last sampled token is `token`."""
    req = make_request(stack, rid, prompt("text"))
    admit(stack, req)
    our_prefill(stack, req)
    req.add_new_token(token)
    return req


@torch.inference_mode()
def _solo_decode(stack: Stack, token: int) -> torch.Tensor:
    req = _decoding_request(stack, 90, token)
    try:
        return stack.engine.forward(ScheduledRequests([], [req]))[0].float()
    finally:
        release(stack, req)


@torch.inference_mode()
def _solo_prefill(stack: Stack, kind: str) -> torch.Tensor:
    req = make_request(stack, 91, prompt(kind))
    admit(stack, req)
    try:
        return our_prefill(stack, req)
    finally:
        release(stack, req)


@pytest.mark.parametrize("kind", ["image", "video"])
@pytest.mark.parametrize("pad_kind", ["image", "video"])
def test_sampled_pad_row_does_not_join_the_merge(stack: Stack, kind: str, pad_kind: str) -> None:
    _check_pad_row_next_to_prefill(stack, kind, pad_kind)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_sampled_pad_row_on_cuda(family: str, tmp_path: Path) -> None:
    """The step rows travel through pinned staging to the device; same result there."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cuda = build_stack(family, write_tiny_checkpoint(family, tmp_path), device="cuda")
    for kind in ("image", "video"):
        _check_pad_row_next_to_prefill(cuda, kind, kind, atol=1e-4)


@torch.inference_mode()
def _check_pad_row_next_to_prefill(
    stack: Stack, kind: str, pad_kind: str, atol: float = ATOL
) -> None:
    pad = _pad_id(stack, pad_kind)
    want_ctx = _solo_prefill(stack, kind)
    want_gen = _solo_decode(stack, pad)
    gen = _decoding_request(stack, 1, pad)
    ctx = make_request(stack, 2, prompt(kind))
    admit(stack, ctx)
    try:
        ctx.context_chunk_size = ctx.prompt_len
        logits = stack.engine.forward(ScheduledRequests([ctx], [gen])).float()
        torch.testing.assert_close(logits[0], want_ctx, atol=atol, rtol=0)
        torch.testing.assert_close(logits[1], want_gen, atol=atol, rtol=0)
    finally:
        release(stack, gen)
        release(stack, ctx)


@torch.inference_mode()
def test_chunked_media_prefill_next_to_pad_rows(stack: Stack) -> None:
    """Two chunks of a two-image prompt, each step next to two decode rows holding pads."""
    want_ctx = _solo_prefill(stack, "two_images")
    want_gen = {k: _solo_decode(stack, _pad_id(stack, k)) for k in ("image", "video")}
    gens = [_decoding_request(stack, 10 + i, _pad_id(stack, k)) for i, k in enumerate(want_gen)]
    ctx = make_request(stack, 3, prompt("two_images"))
    admit(stack, ctx)
    try:
        image_rows = [i for i, t in enumerate(ctx.prompt_token_ids) if t == _pad_id(stack, "image")]
        ctx.context_chunk_size = image_rows[len(image_rows) // 2]  # splits an image block
        stack.engine.forward(ScheduledRequests([ctx], gens))
        ctx.move_to_next_context_chunk()
        ctx.context_chunk_size = ctx.context_remaining_length
        logits = stack.engine.forward(ScheduledRequests([ctx], gens)).float()
        torch.testing.assert_close(logits[0], want_ctx, atol=ATOL, rtol=0)
        for row, kind in zip(logits[1:], want_gen, strict=True):
            torch.testing.assert_close(row, want_gen[kind], atol=ATOL, rtol=0)
    finally:
        for req in (*gens, ctx):
            release(stack, req)
