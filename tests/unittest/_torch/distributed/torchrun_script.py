"""The user script of the torchrun test: one entry point for every rank. Rank 0 prints the
greedy tokens as JSON; under torchrun's variables the other ranks never get past `LLM(...)`."""

from __future__ import annotations

import json
import sys

from tensorrt_llm import LLM, SamplingParams

PROMPTS = ["hello there, how are you", "a much longer prompt " * 4, "short", "one more"]
KWARGS = dict(device="cpu", max_batch_size=2, max_num_tokens=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(checkpoint_dir: str, tensor_parallel_size: int) -> list[list[int]]:
    with LLM(checkpoint_dir, tensor_parallel_size=tensor_parallel_size, **KWARGS) as llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


if __name__ == "__main__":
    tokens = generate(sys.argv[1], int(sys.argv[2]))
    print("TOKENS " + json.dumps(tokens), flush=True)
