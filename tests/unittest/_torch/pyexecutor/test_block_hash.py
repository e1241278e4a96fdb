"""Chained block keys: stable across processes, media and salt in the key, the reuse cap."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tensorrt_llm._torch.pyexecutor.block_hash import (
    MediaSpan,
    block_extra_keys,
    compute_block_keys,
    hash_block_tokens,
    max_reusable_blocks,
    media_spans,
    root_key,
)
from tensorrt_llm.inputs.media_hash import MULTIMODAL_HASHES
from tensorrt_llm.inputs.multimodal import spans_data

TPB = 4
IMG_A = b"\xaa" * 32
IMG_B = b"\xbb" * 32


def _tokens(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 150_000, size=n).tolist()


_SNIPPET = """
import numpy as np
from tensorrt_llm._torch.pyexecutor.block_hash import MediaSpan, compute_block_keys
tokens = np.random.default_rng(7).integers(0, 150_000, size=37).tolist()
spans = [MediaSpan(bytes(range(32)), 5, 9)]
print(",".join(k.hex() for k in compute_block_keys(tokens, 4, spans, cache_salt="tenant")))
"""


def test_keys_are_stable_across_processes() -> None:
    """Python's hash() is salted per process; our keys must not be (a fresh interpreter with
    another PYTHONHASHSEED computes the same ones)."""
    tokens = np.random.default_rng(7).integers(0, 150_000, size=37).tolist()
    ours = compute_block_keys(tokens, 4, [MediaSpan(bytes(range(32)), 5, 9)], cache_salt="tenant")
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _SNIPPET], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip().split(",") == [k.hex() for k in ours]
    assert len(ours) == 9 and all(len(k) == 32 for k in ours)


def test_only_full_blocks_get_keys_and_chain_extends() -> None:
    tokens = _tokens(4 * TPB + 3)
    keys = compute_block_keys(tokens, TPB)
    assert len(keys) == 4
    assert compute_block_keys(tokens[: 2 * TPB], TPB) == keys[:2]
    # Extending from known keys gives the same chain as hashing from scratch.
    assert compute_block_keys(tokens, TPB, known=keys[:2]) == keys
    with pytest.raises(ValueError, match="known keys"):
        compute_block_keys(tokens[:TPB], TPB, known=keys)


def test_chain_equals_block_by_block_hashing() -> None:
    """The sliced whole-sequence encoding gives the one-block function's keys."""
    tokens = _tokens(4 * TPB)
    spans = [MediaSpan(IMG_A, 2, 7)]
    keys = compute_block_keys(tokens, TPB, spans, cache_salt="s")
    parent = root_key("s")
    for i, key in enumerate(keys):
        extra = block_extra_keys(spans, i * TPB, (i + 1) * TPB)
        parent = hash_block_tokens(parent, tokens[i * TPB : (i + 1) * TPB], extra)
        assert key == parent
    assert compute_block_keys(tokens, TPB, spans, known=keys[:3]) == keys


def test_chain_depends_on_every_earlier_token() -> None:
    tokens = _tokens(5 * TPB)
    base = compute_block_keys(tokens, TPB)
    changed = list(tokens)
    changed[TPB + 1] += 1  # a token of block 1
    other = compute_block_keys(changed, TPB)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(other[1:], base[1:], strict=True))


def test_other_image_changes_keys_from_its_first_block_on() -> None:
    """Same tokens, another image in [6, 14): blocks 0 (tokens 0-3) match; 1.. differ."""
    tokens = _tokens(6 * TPB)
    a = compute_block_keys(tokens, TPB, [MediaSpan(IMG_A, 6, 8)])
    b = compute_block_keys(tokens, TPB, [MediaSpan(IMG_B, 6, 8)])
    plain = compute_block_keys(tokens, TPB)
    assert a[0] == b[0] == plain[0]
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))
    assert a[1] != plain[1]
    # The same image again gives the same keys.
    assert compute_block_keys(tokens, TPB, [MediaSpan(IMG_A, 6, 8)]) == a


def test_same_image_at_another_position_differs() -> None:
    """Pad ids are identical wherever the run sits; the run's offset must be in the key."""
    tokens = [1] * (4 * TPB)  # all "pad": only the span decides
    at5 = compute_block_keys(tokens, TPB, [MediaSpan(IMG_A, 5, 6)])
    at6 = compute_block_keys(tokens, TPB, [MediaSpan(IMG_A, 6, 6)])
    assert at5[0] == at6[0]  # block 0 holds none of either run
    assert at5[1] != at6[1]


def test_extra_keys_pick_overlapping_runs_with_relative_offsets() -> None:
    spans = [MediaSpan(IMG_A, 2, 3), MediaSpan(IMG_B, 5, 8)]
    assert block_extra_keys(spans, 0, 4) == [(IMG_A, 2)]
    assert block_extra_keys(spans, 4, 8) == [(IMG_A, -2), (IMG_B, 1)]
    assert block_extra_keys(spans, 8, 12) == [(IMG_B, -3)]
    assert block_extra_keys(spans, 16, 20) == []
    assert block_extra_keys(spans, 4, 5) == [(IMG_A, -2)]  # B starts at the block's end


def test_extra_keys_match_a_linear_scan_over_many_runs() -> None:
    """The bisection against the obvious definition, over a video-like run layout."""
    spans = [MediaSpan(bytes([i]) * 32, 3 + 7 * i, 1 + i % 5) for i in range(60)]
    for start in range(0, 440, 3):
        hits = [s for s in spans if s.start < start + 4 and s.end > start]
        expected = [(s.content_hash, s.start - start) for s in hits]
        assert block_extra_keys(spans, start, start + 4) == expected


def test_overlapping_runs_are_rejected() -> None:
    with pytest.raises(ValueError, match="overlap"):
        compute_block_keys([0] * 8, TPB, [MediaSpan(IMG_A, 0, 4), MediaSpan(IMG_B, 3, 2)])


def test_salt_separates_chains() -> None:
    tokens = _tokens(3 * TPB)
    plain = compute_block_keys(tokens, TPB)
    assert compute_block_keys(tokens, TPB, cache_salt=None) == plain
    a = compute_block_keys(tokens, TPB, cache_salt="a")
    assert compute_block_keys(tokens, TPB, cache_salt=b"a") == a
    assert not set(a) & set(plain)
    assert not set(a) & set(compute_block_keys(tokens, TPB, cache_salt="b"))
    assert root_key("ab") != root_key("a")


def test_encoding_is_unambiguous() -> None:
    parent = root_key()
    assert hash_block_tokens(parent, [1, 2]) != hash_block_tokens(parent, [1, 2, 0])
    assert hash_block_tokens(parent, [1], [(IMG_A, 0)]) != hash_block_tokens(parent, [1])
    assert hash_block_tokens(parent, [1], [(IMG_A, 0)]) != hash_block_tokens(
        parent, [1], [(IMG_A, 1)]
    )
    # Token ids beyond 32 bits are kept whole.
    assert hash_block_tokens(parent, [1 << 33]) != hash_block_tokens(parent, [0])


@pytest.mark.parametrize(
    ("prompt_len", "expected"), [(1, 0), (4, 0), (5, 1), (8, 1), (9, 2), (0, 0)]
)
def test_reuse_cap_leaves_one_token(prompt_len: int, expected: int) -> None:
    assert max_reusable_blocks(prompt_len, TPB) == expected


def test_media_spans_from_multimodal_data() -> None:
    """Two images (grids of 16 and 8 patches, merge 2 -> 4 and 2 tokens) and one video of
    two temporal patches with a run each (Qwen3-VL layout: 2 runs of 2 tokens)."""
    data = {
        "image": {
            "pixel_values": torch.zeros(24, 3),
            "image_grid_thw": torch.tensor([[1, 4, 4], [1, 2, 4]]),
        },
        "video": {
            "pixel_values_videos": torch.zeros(16, 3),
            "video_grid_thw": torch.tensor([[2, 2, 4]]),
        },
        MULTIMODAL_HASHES: {"image": [IMG_A.hex(), IMG_B.hex()], "video": [(b"v" * 32).hex()]},
        **spans_data({"image": ([3, 20], [4, 2]), "video": ([10, 14], [2, 2])}),
    }
    spans = media_spans(data, merge_size=2)
    assert spans == [
        MediaSpan(IMG_A, 3, 4),
        MediaSpan(b"v" * 32, 10, 2),
        MediaSpan(b"v" * 32, 14, 2),
        MediaSpan(IMG_B, 20, 2),
    ]
    assert media_spans(None, 2) == [] and media_spans({}, 2) == []
    del data[MULTIMODAL_HASHES]
    with pytest.raises(ValueError, match="content hash"):
        media_spans(data, merge_size=2)
