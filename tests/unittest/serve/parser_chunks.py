"""Ways of cutting one text into stream deltas, shared by the parser tests."""

from __future__ import annotations

import random

# The seeds of the random cuts: fixed, so a failure names a reproducible chunking.
SEEDS = (0, 1, 2, 3, 4)
CHUNKINGS = ["whole", "chars", *(f"random{seed}" for seed in SEEDS)]


def chunks(text: str, how: str) -> list[str]:
    """`text` cut as `how` says: whole, one character each, or random sizes 1-7 (seeded)."""
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(int(how.removeprefix("random")))
    out, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, 7)
        out.append(text[pos : pos + size])
        pos += size
    return out
