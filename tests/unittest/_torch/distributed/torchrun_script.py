"""The user script of the torchrun tests (`script CKPT TP [DEVICE]`): one entry point for
every rank. Rank 0 prints the greedy tokens as JSON; under torchrun's variables the other ranks
never get past `LLM(...)`."""

from __future__ import annotations

import json
import sys

from tensorrt_llm import LLM, SamplingParams

PROMPTS = ["hello there, how are you", "a much longer prompt " * 4, "short", "one more"]
KWARGS = dict(max_batch_size=2, max_num_tokens=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def generate(
    checkpoint_dir: str, tensor_parallel_size: int, device: str = "cpu"
) -> list[list[int]]:
    # CUDA: float32 and no graphs (tp > 1 refuses them), so TP=1 and TP=2 compare exactly.
    extra = dict(dtype="float32", cuda_graph_config=None) if device == "cuda" else {}
    llm = LLM(
        checkpoint_dir, tensor_parallel_size=tensor_parallel_size, device=device, **KWARGS, **extra
    )
    with llm:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


if __name__ == "__main__":
    tokens = generate(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
    print("TOKENS " + json.dumps(tokens), flush=True)
