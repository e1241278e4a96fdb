"""The engine's MTP drafts (chunked prefill, verify steps, rollback replays, chained passes)
equal a plain reference: the target's hidden states from one prefill of the sequence, the MTP
head over every position in one chunk, then one position per further draft."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from paged_kv_helpers import FakeKVCacheManager, build_metadata

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.modules.rotary_embedding import MRotaryEmbedding
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_decode.setup import text_lm
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

K = 3
PROMPTS = [list(range(9 + i, 9 + i + n)) for i, n in enumerate((21, 6, 10))]


def _positions(lm: torch.nn.Module, start: int, n: int) -> torch.Tensor:
    pos = torch.arange(start, start + n)
    if isinstance(lm.model.rotary_emb, MRotaryEmbedding):  # text tokens: all axes alike
        return pos.view(1, 1, -1).expand(3, 1, -1)
    return pos.view(1, -1)


@torch.inference_mode()
def _reference_drafts(lm: torch.nn.Module, tokens: list[int], num_drafts: int) -> list[int]:
    """Drafts after `tokens` (the last one not yet run through the target)."""
    text = lm.config
    num_full = sum(t == "full_attention" for t in text.layer_types)
    manager = FakeKVCacheManager(num_full + 1, 64, 4, text.num_key_value_heads, text.head_dim)
    ids = torch.tensor(tokens)
    n = len(tokens) - 1
    pos = _positions(lm, 0, n)
    hidden = lm.model(build_metadata(manager, [(0, n, 0)]), input_ids=ids[:n], position_ids=pos)
    embed = lm.model.embed_tokens
    cos_sin = lm.model.get_cos_sin(pos)
    out = lm.mtp(embed(ids[1:]), hidden, cos_sin, build_metadata(manager, [(0, n, 0)]), 0)
    state = out[-1:]
    token = lm.lm_logits(state)[:, : text.vocab_size].argmax(-1)
    drafts = [int(token)]
    for step in range(1, num_drafts):
        at = n - 1 + step
        md = build_metadata(manager, [(0, 1, at)])
        cos_sin = lm.model.get_cos_sin(_positions(lm, at, 1))
        state = lm.mtp(embed(token), state, cos_sin, md, step)
        token = lm.lm_logits(state)[:, : text.vocab_size].argmax(-1)
        drafts.append(int(token))
    return drafts


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_engine_drafts_match_reference(family: str, tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint(family, tmp_path / family, mtp_num_hidden_layers=1)
    seen: list[tuple[list[int], list[int]]] = []

    def record(req: LlmRequest, drafts: list[int]) -> list[int]:
        tokens = [int(t) for t in req.prompt_token_array] + list(req.output_token_ids)
        if drafts:
            seen.append((tokens, list(drafts)))
        return drafts

    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": K}
    with LLM(
        model=str(ckpt), device="cpu", executor_mode="inproc", disable_overlap_scheduler=True,
        speculative_config=spec, max_num_tokens=16, tokens_per_block=4, max_batch_size=4,
    ) as llm:  # fmt: skip
        llm._executor.spec_decoder.draft_override = record
        params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        lm = text_lm(llm._executor.model_engine.model)
        # The engine is idle now: the reference may use its model (slot 0, fresh KV).
        assert len(seen) >= len(PROMPTS) * 4
        for tokens, drafts in seen:
            assert drafts == _reference_drafts(lm, tokens, len(drafts)), tokens
