"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL through our engine vs the HF transformers reference.

Same tiny random checkpoint on both sides, fp32 on CPU. Covered: prefill logits and 8 greedy
decode steps (image, two images of different sizes, video, text only), mixed batches against solo
runs, a chunk boundary inside an image block, and seq-slot reuse with different deltas.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from vl_parity_helpers import (
    HF_CLASS,
    Stack,
    admit,
    build_stack,
    hf_logits,
    make_request,
    our_decode,
    our_prefill,
    prompt,
    release,
)

from tensorrt_llm._torch.models.modeling_auto import import_all_models
from tensorrt_llm._torch.models.modeling_multimodal_utils import MROPE_DEVICE_PATHS
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = tuple(HF_CLASS)
KINDS = ("text", "image", "two_images", "video")
ATOL = 1e-4
DECODE_STEPS = 8


@pytest.fixture(scope="module", params=FAMILIES)
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    family = request.param
    ckpt = write_tiny_checkpoint(family, Path(tmp_path_factory.mktemp(family)))
    return build_stack(family, ckpt)


def _greedy_ours(stack: Stack, kind: str, chunk: int | None = None) -> list[int]:
    req = make_request(stack, 1, prompt(kind))
    admit(stack, req)
    try:
        logits = our_prefill(stack, req, chunk)
        tokens = []
        for _ in range(DECODE_STEPS):
            tok = int(logits.argmax())
            tokens.append(tok)
            req.add_new_token(tok)
            logits = our_decode(stack, [req])[0]
        return tokens
    finally:
        release(stack, req)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_hf(stack: Stack, kind: str) -> None:
    req = make_request(stack, 1, prompt(kind))
    ids, data = list(req.prompt_token_ids), req.hf_inputs
    admit(stack, req)
    try:
        req.context_chunk_size = req.prompt_len
        ours = stack.engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        ref = hf_logits(stack, ids, data)
        torch.testing.assert_close(ours.float(), ref, atol=ATOL, rtol=0)
        logits = ours[-1].float()
        for _ in range(DECODE_STEPS):
            tok = int(logits.argmax())
            ids.append(tok)
            req.add_new_token(tok)
            logits = our_decode(stack, [req])[0]
            torch.testing.assert_close(logits, hf_logits(stack, ids, data)[-1], atol=ATOL, rtol=0)
    finally:
        release(stack, req)


def test_mixed_batch_matches_solo_runs(stack: Stack) -> None:
    kinds = ["text", "image", "video", "two_images", "text", "image", "video", "text"]
    solo_by_kind = {kind: _greedy_ours(stack, kind) for kind in set(kinds)}
    solo = [solo_by_kind[kind] for kind in kinds]
    reqs = [make_request(stack, 100 + i, prompt(kind)) for i, kind in enumerate(kinds)]
    for req in reqs:
        admit(stack, req)
    try:
        outs: list[list[int]] = [[] for _ in reqs]
        # Staggered: half the requests prefill while the other half already decode.
        first, second = reqs[:4], reqs[4:]
        for group in (first, second):
            for req in group:
                req.context_chunk_size = req.prompt_len
            gen = [r for r in reqs if r.is_generation]
            logits = stack.engine.forward(ScheduledRequests(group, gen))
            for req, row in zip(group + gen, logits, strict=True):
                tok = int(row.argmax())
                outs[reqs.index(req)].append(tok)
                req.add_new_token(tok)
        while any(len(o) < DECODE_STEPS for o in outs):
            live = [r for r, o in zip(reqs, outs, strict=True) if len(o) < DECODE_STEPS]
            logits = our_decode(stack, live)
            for req, row in zip(live, logits, strict=True):
                tok = int(row.argmax())
                outs[reqs.index(req)].append(tok)
                req.add_new_token(tok)
        assert outs == solo
    finally:
        for req in reqs:
            release(stack, req)


def test_chunk_boundary_inside_image_block(stack: Stack) -> None:
    req = make_request(stack, 7, prompt("two_images"))
    image_positions = [i for i, t in enumerate(req.prompt_token_ids) if t == req_image_id(stack)]
    chunk = image_positions[len(image_positions) // 3] + 1  # splits the first image block
    assert chunk < req.prompt_len
    assert _greedy_ours(stack, "two_images", chunk=chunk) == _greedy_ours(stack, "two_images")


def req_image_id(stack: Stack) -> int:
    return stack.engine.model.image_token_id  # type: ignore[return-value]


def test_recycled_slot_uses_its_own_delta(stack: Stack) -> None:
    expected_video = _greedy_ours(stack, "video")
    expected_text = _greedy_ours(stack, "text")
    first = make_request(stack, 20, prompt("two_images"))
    admit(stack, first)
    our_prefill(stack, first)
    slot = first.seq_slot
    release(stack, first)
    outs = {}
    for rid, kind in ((21, "video"), (22, "text")):
        req = make_request(stack, rid, prompt(kind))
        admit(stack, req)
        assert req.seq_slot == slot
        delta = int(req.multimodal_params.get("mrope_config.mrope_position_deltas").reshape(-1)[0])
        logits = our_prefill(stack, req)
        assert int(stack.engine.model.mrope_position_deltas_cache[slot]) == delta
        toks = []
        for _ in range(DECODE_STEPS):
            toks.append(int(logits.argmax()))
            req.add_new_token(toks[-1])
            logits = our_decode(stack, [req])[0]
        outs[kind] = toks
        release(stack, req)
    assert outs == {"video": expected_video, "text": expected_text}


def test_every_registered_vl_class_lists_both_mrope_paths() -> None:
    # Selected by the declared capability: a VL class that listed no paths at all is caught.
    vl_classes = [cls for cls in import_all_models().values() if cls.uses_mrope]
    assert len(vl_classes) >= 3
    for cls in vl_classes:
        for path in MROPE_DEVICE_PATHS:
            assert path in cls.multimodal_data_device_paths, (cls.__name__, path)


@pytest.mark.gpu
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_bf16_matches_hf(family: str, kind: str, tmp_path: Path) -> None:
    """The same parity on CUDA in bf16 (loose tolerance), decode teacher-forced on HF tokens."""
    stack = build_stack(
        family, write_tiny_checkpoint(family, tmp_path), device="cuda", dtype=torch.bfloat16
    )
    req = make_request(stack, 1, prompt(kind))
    ids, data = list(req.prompt_token_ids), req.hf_inputs
    admit(stack, req)
    req.context_chunk_size = req.prompt_len
    ours = stack.engine.forward(ScheduledRequests([req], []), return_context_logits=True)
    ref = hf_logits(stack, ids, data)
    torch.testing.assert_close(ours.float().cpu(), ref, atol=5e-2, rtol=0)
    for _ in range(DECODE_STEPS):
        tok = int(ref[-1].argmax())
        ids.append(tok)
        req.add_new_token(tok)
        logits = our_decode(stack, [req])[0].cpu()
        ref = hf_logits(stack, ids, data)
        torch.testing.assert_close(logits, ref[-1], atol=5e-2, rtol=0)
    release(stack, req)


def test_deepstack_inputs_reuse_one_scratch_buffer(stack: Stack) -> None:
    """Media steps of deepstack models build their deepstack inputs in one kept buffer (no
    per-step allocation); `test_mixed_batch_matches_solo_runs` checks nothing stale leaks."""
    model = stack.engine.model
    if not model.has_deepstack:
        pytest.skip("this family has no deepstack")
    _greedy_ours(stack, "two_images")
    scratch = model._deepstack_scratch
    assert scratch is not None and scratch.shape[0] == len(model.visual.deepstack_visual_indexes)
    _greedy_ours(stack, "image")  # a shorter prompt: same storage
    assert model._deepstack_scratch.data_ptr() == scratch.data_ptr()
