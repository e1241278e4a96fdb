"""Tiny checkpoints with YaRN rope scaling give HF's logits (text RoPE, contiguous and
interleaved mRoPE, the hybrid Qwen3.5 stack); unsupported rope types fail at load.

fp32 on CPU. YaRN parameters are chosen so the ramp lands inside the tiny rotary dims (some
frequencies interpolated, some extrapolated) and the attention factor differs from 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from paged_kv_helpers import build_metadata
from vl_parity_helpers import admit, build_stack, hf_logits, make_request, prompt, release

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.weight_loading import load_model
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

# 4096 tiny positions = 4 x 1024: consistent with HF's implicit factor check.
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}
ATOL = 1e-4


def _load_ours(ckpt: Path) -> torch.nn.Module:
    config = load_pretrained_config(ckpt)
    cls = get_model_class(resolve_architecture(config))
    return load_model(cls, ModelConfig(config, checkpoint_dir=str(ckpt)), "cpu")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(tmp_path_factory.mktemp("yarn"))


def _ckpt(root: Path, family: str, rope: dict[str, Any] | None = YARN) -> Path:
    name = f"{family}-{'plain' if rope is None else rope['rope_type']}"
    if (root / name).is_dir():
        return root / name
    if rope is None:
        return write_tiny_checkpoint(family, root / name)
    return write_tiny_checkpoint(family, root / name, rope_scaling=rope)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_text_checkpoint_with_yarn_matches_hf(root: Path, family: str) -> None:
    ckpt = _ckpt(root, family)
    ours = _load_ours(ckpt)
    assert ours.model.rotary_emb.scaling is not None
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 512, (n,), generator=gen) for n in (37, 90)]
    md = build_metadata(None, [(0, 37, 0), (1, 90, 0)])
    pos = torch.cat([torch.arange(37), torch.arange(90)])[None]
    with torch.no_grad():
        got = ours(md, input_ids=torch.cat(seqs), position_ids=pos, return_context_logits=True)
        expected = torch.cat([hf(input_ids=s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    # The same checkpoint without YaRN gives other logits (so the comparison above can fail).
    plain = _load_ours(_ckpt(root, family, None))
    with torch.no_grad():
        other = plain(md, input_ids=torch.cat(seqs), position_ids=pos, return_context_logits=True)
    assert (other - expected).abs().max() > 100 * ATOL


@pytest.mark.parametrize(
    ("family", "hf_class"),
    [
        ("qwen2_vl", "Qwen2VLForConditionalGeneration"),  # contiguous mRoPE
        ("qwen3_vl", "Qwen3VLForConditionalGeneration"),  # interleaved mRoPE
        ("qwen3_5", "Qwen3_5ForConditionalGeneration"),  # interleaved, partial rotary, hybrid
    ],
)
@pytest.mark.parametrize("kind", ["image", "text"])
def test_vl_checkpoint_with_yarn_matches_hf(
    root: Path, family: str, hf_class: str, kind: str
) -> None:
    """Prefill logits of every prompt token and two decode steps through the engine."""
    stack = build_stack(family, _ckpt(root, family), hf_class=hf_class)
    assert stack.engine.model.rotary_emb.scaling is not None
    req = make_request(stack, 1, prompt(kind))
    ids, data = list(req.prompt_token_ids), req.hf_inputs
    admit(stack, req)
    try:
        req.context_chunk_size = req.prompt_len
        ours = stack.engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        torch.testing.assert_close(ours.float(), hf_logits(stack, ids, data), atol=ATOL, rtol=0)
        logits = ours[-1].float()
        for _ in range(2):
            tok = int(logits.argmax())
            ids.append(tok)
            req.add_new_token(tok)
            logits = stack.engine.forward(ScheduledRequests([], [req]))[0].float()
            torch.testing.assert_close(logits, hf_logits(stack, ids, data)[-1], atol=ATOL, rtol=0)
    finally:
        release(stack, req)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_vl"])
@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
def test_unsupported_rope_type_fails_at_load(root: Path, family: str, rope_type: str) -> None:
    ckpt = _ckpt(root, family, {"rope_type": rope_type, "factor": 2.0})
    with pytest.raises(ValueError, match=rf"unsupported rope_type '{rope_type}'.*yarn"):
        _load_ours(ckpt)
