"""Tiny text-only MoE and hybrid checkpoints (Qwen3-MoE, Qwen3.5, Qwen3.5-MoE causal LMs).

`tools.tiny_checkpoint` builds the VL families and the dense text LLMs; the registered MoE and
hybrid text LLMs reuse a VL family's text sizes and tokenizer: the HF causal LM with random
weights, saved beside the VL checkpoint's tokenizer files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

# text architecture -> the tiny VL family whose text stack it is
TEXT_FAMILIES = {
    "Qwen3MoeForCausalLM": "qwen3_vl_moe",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
}
_QWEN3_MOE_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "num_experts", "num_experts_per_tok",
    "moe_intermediate_size", "intermediate_size",
)  # fmt: skip


def write_text_checkpoint(arch: str, root: Path) -> Path:
    vl = write_tiny_checkpoint(TEXT_FAMILIES[arch], root / "vl")
    text = load_pretrained_config(vl).text_config
    if arch == "Qwen3MoeForCausalLM":
        # Plain Qwen3-MoE: the Qwen3-VL-MoE text sizes with 1-D RoPE.
        text = transformers.Qwen3MoeConfig(
            **{k: getattr(text, k) for k in _QWEN3_MOE_KEYS},
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rope_theta=1e6, tie_word_embeddings=False,
        )  # fmt: skip
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(text)
    with torch.no_grad():  # HF's constant norms would make every layer alike
        for param in hf.parameters():
            if param.dim() == 1:
                param.normal_(0.0 if bool((param == 0).all()) else 1.0, 0.2)
    out = root / arch
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (vl / name).exists():
            shutil.copy(vl / name, out / name)
    return out
