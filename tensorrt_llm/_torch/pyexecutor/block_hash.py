"""Content keys of full KV blocks, for prefix caching (KV block reuse).

A block's key must name everything its KV depends on: every token before it (its position and
the attention over the prefix) and its own tokens. Chaining does that cheaply: block i's key is
a hash of (block i-1's key, block i's token ids, block i's extra keys), so two requests share
block i's key only when they agree on all of blocks 0..i.

Extra keys cover what token ids do not say. A vision placeholder run is the same pad id
repeated whatever the image, so each block records, for every media run that overlaps it, the
item's content hash (`inputs/media_hash.py`) and the run's start relative to the block's start;
the same image moved by one token then changes the key too. The chain also makes an earlier
image reach every later block, which is right: those tokens attended to it.

The root of a chain mixes in an optional `cache_salt` (vLLM's per-request field): requests with
different salts never share blocks, so a tenant cannot learn from timing whether another tenant
sent a prefix. One engine serves one model, so no per-model namespace is needed; LoRA is not
supported, so no adapter id is mixed in either.

NOTE: SHA-256 over a fixed byte encoding, never Python's `hash()` (salted per process): keys must
agree between the preprocessing workers, the engine process and runs of the engine.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...inputs.media_hash import MULTIMODAL_HASHES, PIXEL_KEYS, item_runs

BlockKey = bytes  # a 32-byte SHA-256 digest

# Bumped whenever the encoding below changes, so keys of another encoding can never match.
_KEY_VERSION = b"trtllm-kv-block-v1"


@dataclass(frozen=True)
class MediaSpan:
    """One run of vision placeholder tokens in a prompt and the item it belongs to.

    content_hash: the item's `media_hash.hash_multimodal_item` digest.
    start, length: the run's tokens are prompt positions [start, start + length). An item may
      have several runs (Qwen3-VL videos: one per temporal patch, timestamps in between); each
      run is a span of its own with the item's hash.
    """

    content_hash: bytes
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


def root_key(cache_salt: str | bytes | None = None) -> BlockKey:
    """The parent key of block 0: the encoding version plus the optional cache salt."""
    h = hashlib.sha256(_KEY_VERSION)
    if cache_salt is not None:
        salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else bytes(cache_salt)
        # Length-prefixed, so no salt is a prefix-extension of another's encoding.
        h.update(len(salt).to_bytes(8, "little"))
        h.update(salt)
    return h.digest()


def hash_block_tokens(
    parent: BlockKey,
    token_ids: Sequence[int] | np.ndarray,
    extra_keys: Sequence[tuple[bytes, int]] = (),
) -> BlockKey:
    """Key of one block from its parent's key, its token ids and its extra keys.

    extra_keys: (content hash, run start minus block start) per overlapping media run, in
      prompt order. The offset may be negative (a run that began in an earlier block).
    """
    tokens = np.asarray(token_ids, dtype=np.int64)
    return _hash_encoded(parent, tokens.astype("<i8", copy=False).tobytes(), extra_keys)


def _hash_encoded(
    parent: BlockKey, token_bytes: bytes | memoryview, extra_keys: Sequence[tuple[bytes, int]]
) -> BlockKey:
    """`hash_block_tokens` over tokens already encoded as little-endian int64."""
    h = hashlib.sha256(parent)
    # Counts first, so the split between tokens and extra keys is never ambiguous.
    h.update((len(token_bytes) // 8).to_bytes(4, "little"))
    h.update(token_bytes)
    h.update(len(extra_keys).to_bytes(4, "little"))
    for content_hash, offset in extra_keys:
        h.update(len(content_hash).to_bytes(2, "little"))
        h.update(content_hash)
        h.update(int(offset).to_bytes(8, "little", signed=True))
    return h.digest()


def block_extra_keys(
    spans: Sequence[MediaSpan],
    block_start: int,
    block_end: int,
    ends: Sequence[int] | None = None,
) -> list[tuple[bytes, int]]:
    """(content hash, start offset) of the spans overlapping [block_start, block_end).

    `spans` must be sorted by start and not overlap (placeholder runs never do), so their ends
    are sorted too and a bisection finds the first overlapping one: a long video has hundreds
    of runs and a long prompt thousands of blocks. `ends` (the spans' ends, precomputed by a
    caller that asks for many blocks) saves rebuilding that list per block.
    """
    ends = [span.end for span in spans] if ends is None else ends
    out: list[tuple[bytes, int]] = []
    for i in range(bisect.bisect_right(ends, block_start), len(spans)):
        span = spans[i]
        if span.start >= block_end:
            break
        out.append((span.content_hash, span.start - block_start))
    return out


def max_reusable_blocks(prompt_len: int, tokens_per_block: int) -> int:
    """Most prompt blocks a request may take from the cache.

    At least one prompt token must run through the model: its logits give the first output
    token. So the hit stops one token short of the prompt, rounded down to whole blocks.
    """
    if prompt_len < 1:
        return 0
    return (prompt_len - 1) // tokens_per_block


def compute_block_keys(
    token_ids: Sequence[int] | np.ndarray,
    tokens_per_block: int,
    spans: Sequence[MediaSpan] = (),
    cache_salt: str | bytes | None = None,
    known: Sequence[BlockKey] = (),
) -> list[BlockKey]:
    """Keys of every full block of `token_ids` (a trailing partial block has none).

    known: keys already computed for the leading blocks of the same token sequence (e.g. the
      prompt's, when generated tokens filled more blocks); they are kept and the chain goes on
      from the last one, so a growing request hashes each block once.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    num_full = tokens.shape[0] // tokens_per_block
    if len(known) > num_full:
        raise ValueError(f"{len(known)} known keys but only {num_full} full blocks")
    keys = list(known)
    parent = keys[-1] if keys else root_key(cache_salt)
    ordered = sorted(spans, key=lambda s: s.start)
    ends = [span.end for span in ordered]
    for prev, span in zip(ordered, ordered[1:], strict=False):
        if span.start < prev.end:
            raise ValueError(f"media runs overlap: {prev} and {span}")
    # One encoding of the whole sequence, sliced per block: per-block numpy conversions were
    # half the cost. 100k tokens (3125 blocks of 32) take ~15 ms on the development machine.
    encoded = memoryview(tokens[len(keys) * tokens_per_block :].astype("<i8").tobytes())
    width = tokens_per_block * 8
    for n, index in enumerate(range(len(keys), num_full)):
        begin = index * tokens_per_block
        extra = block_extra_keys(ordered, begin, begin + tokens_per_block, ends) if ordered else []
        parent = _hash_encoded(parent, encoded[n * width : (n + 1) * width], extra)
        keys.append(parent)
    return keys


def media_spans(multimodal_data: dict[str, Any] | None, merge_size: int) -> list[MediaSpan]:
    """The prompt's media runs with their items' hashes, sorted by start.

    Reads `multimodal_data[MULTIMODAL_HASHES]` (hex digests the input processor recorded) and
    the placeholder spans. Raises ValueError when an item with pixels has no hash: hashing it
    here, in the engine loop, would be slow, and reusing KV without it would be wrong.
    """
    if not multimodal_data:
        return []
    hashes = multimodal_data.get(MULTIMODAL_HASHES) or {}
    out: list[MediaSpan] = []
    for modality in PIXEL_KEYS:
        items = item_runs(multimodal_data, modality, merge_size)
        digests = hashes.get(modality, [])
        if len(digests) != len(items):
            raise ValueError(f"{len(items)} {modality} item(s) but {len(digests)} content hash(es)")
        for digest, runs in zip(digests, items, strict=True):
            content = bytes.fromhex(digest)
            out.extend(MediaSpan(content, int(s), int(n)) for s, n in runs)
    out.sort(key=lambda span: span.start)
    return out
