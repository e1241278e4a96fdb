"""Issue 13, defect 1 at the LLM level: a decoding request whose input token is the image pad
shares a step with another request's image prefill.

Scenario (demo checkpoint, max_batch_size=2): A ("hello", temperature 2.0, seeded, ignore_eos)
and a filler C (max_tokens=9) run first; B (one image) waits for C's slot and is admitted in
the step where A decodes from its 10th (overlap executor) or 9th (sequential executor) token.
The seeds make that token `<|image_pad|>` (checked below, so the test cannot pass vacuously).
Before the fix the step's merge matched A's row as an image row and every request failed.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from PIL import Image

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import SPECIAL_IDS, get_or_build_demo_checkpoint

IMAGE_PAD = SPECIAL_IDS["<|image_pad|>"]
DEMO_IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
IMAGE_PROMPT = {
    "prompt": "<|vision_start|><|image_pad|><|vision_end|> what is it",
    "multi_modal_data": {"image": [Image.open(DEMO_IMAGE).convert("RGB")]},
}


@contextmanager
def _no_thread_switch() -> Iterator[None]:
    """Keep the GIL while the three requests are enqueued, so the executor sees them together
    (the slot hand-over from C to B then happens at a known step). Blocking waits still
    release it at once."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run(llm: LLM, seed: int, pad_index: int) -> tuple[list, list]:
    sp_a = SamplingParams(temperature=2.0, seed=seed, ignore_eos=True, max_tokens=14)
    sp_c = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    sp_b = SamplingParams(max_tokens=4, temperature=0.0)
    # `generate` processes every input first and then enqueues them back to back.
    with _no_thread_switch():
        outs = llm.generate(
            ["hello", "filler text", IMAGE_PROMPT], [sp_a, sp_c, sp_b], use_tqdm=False
        )
    a_tokens = outs[0].outputs[0].token_ids
    assert a_tokens[pad_index] == IMAGE_PAD, "precondition: A samples the image pad there"
    return outs, [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(
    ("disable_overlap", "seed", "pad_index"), [(False, 463, 9), (True, 430, 8)]
)
def test_sampled_image_pad_does_not_fail_the_step(
    disable_overlap: bool, seed: int, pad_index: int
) -> None:
    with LLM(
        model=str(get_or_build_demo_checkpoint()),
        device="cpu",
        max_batch_size=2,
        disable_overlap_scheduler=disable_overlap,
    ) as llm:
        outs, tokens = _run(llm, seed, pad_index)
        for out in outs:
            assert out.outputs[0].finish_reason == "length", out.outputs[0]
            assert getattr(out, "error", None) is None
        # Each request alone gives the same tokens (seeded / greedy sampling).
        solo_b = llm.generate(IMAGE_PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
        assert tokens[2] == solo_b.outputs[0].token_ids
        stats = llm.get_stats()
        assert stats.num_free_seq_slots == stats.num_total_seq_slots
