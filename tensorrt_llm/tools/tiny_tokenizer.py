"""The tiny checkpoints' tokenizer and processing files: a locally trained byte-level BPE with the
Qwen special tokens, a Qwen-style chat template, and the image/video processor configs.

Shared by the tiny-checkpoint writer and `trtllm-bench` (which pairs these files with real-size
configs and random weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BPE_VOCAB_SIZE = 400
# NOTE: the special tokens sit right after the trained BPE vocab, in Qwen's order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
SPECIAL_IDS: dict[str, int] = {tok: BPE_VOCAB_SIZE + i for i, tok in enumerate(SPECIAL_TOKENS)}

# A small fixed English corpus: enough distinct pairs for exactly BPE_VOCAB_SIZE - 256 merges.
_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "A picture shows a red square, a green circle and a blue triangle on a white table.",
    "Describe this image in one sentence. What colour is the large shape in the middle?",
    "The video shows a small cat walking across the kitchen floor and then sitting down.",
    "There are three people standing in front of the old stone building in the city.",
    "Please answer the question about the picture with a short and clear answer.",
    "The weather today is sunny and warm, with a light wind coming from the west.",
    "She reads a book about history, science, music and the art of painting.",
    "How many birds are sitting on the wire? I can count seven birds in total.",
    "The model looks at each frame of the video and writes a caption for it.",
    "Numbers like 1, 2, 3, 10, 42 and 100 appear in the text from time to time.",
    "Yes, the man is holding an umbrella because it is raining outside the station.",
    "The mountain is covered with snow, and the sky above it is bright and clear.",
    "Children are playing football in the park while their parents watch them.",
    "This is a test of the tokenizer, the chat template and the image processor.",
    "Tell me what you see: a yellow car, a tall tree and a long road to the hills.",
)

# Qwen-style chat template: no default system prompt, images and videos as pad placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer() -> Any:
    """Byte-level BPE trained on _CORPUS (deterministic), plus the Qwen special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(_CORPUS), trainer)
    if tok.get_vocab_size() != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE vocab is {tok.get_vocab_size()}, expected {BPE_VOCAB_SIZE}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for text, tid in SPECIAL_IDS.items():
        if tok.token_to_id(text) != tid:
            raise RuntimeError(f"special token {text} landed at {tok.token_to_id(text)}, not {tid}")
    return tok


def tokenizer_config() -> dict[str, Any]:
    decoder = {
        str(tid): {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for text, tid in SPECIAL_IDS.items()
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
    }


def processor_configs(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    vision = cfg["vision_config"]
    patch, merge = vision["patch_size"], vision["spatial_merge_size"]
    factor = patch * merge
    # Small pixel budget: a tiny image gives 4..64 merged tokens, a video frame at most 16.
    min_px, max_px, max_video_px = factor * factor * 4, factor * factor * 64, factor * factor * 16
    legacy = cfg["model_type"] in ("qwen2_vl", "qwen2_5_vl")
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}.get(
        cfg["model_type"], "Qwen3VLProcessor"
    )
    mean = [0.48145466, 0.4578275, 0.40821073] if legacy else [0.5, 0.5, 0.5]
    std = [0.26862954, 0.26130258, 0.27577711] if legacy else [0.5, 0.5, 0.5]
    common = {
        "patch_size": patch,
        "temporal_patch_size": vision["temporal_patch_size"],
        "merge_size": merge,
        "image_mean": mean,
        "image_std": std,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
        "processor_class": processor,
    }
    image = dict(
        common,
        image_processor_type="Qwen2VLImageProcessor",
        min_pixels=min_px,
        max_pixels=max_px,
        size={"shortest_edge": min_px, "longest_edge": max_px},
    )
    video_type = "Qwen2VLVideoProcessor" if legacy else "Qwen3VLVideoProcessor"
    video = dict(
        common,
        video_processor_type=video_type,
        min_pixels=min_px,
        max_pixels=max_video_px,
        size={"shortest_edge": min_px, "longest_edge": max_video_px},
        fps=2.0,
        min_frames=2,
        max_frames=16,
        do_sample_frames=False,
    )
    return image, video


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": SPECIAL_IDS["<|endoftext|>"],
        "eos_token_id": [SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]],
        "pad_token_id": SPECIAL_IDS["<|endoftext|>"],
        "do_sample": False,
    }


def _dump(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_processing_files(out: Path, cfg: dict[str, Any], max_pixels: int | None = None) -> None:
    """Write tokenizer, chat template, generation and processor configs for `cfg` into `out`.

    `max_pixels` raises the image processor's pixel budget (benchmarks with large images).
    """
    _dump(out / "generation_config.json", generation_config(cfg))
    build_tokenizer().save(str(out / "tokenizer.json"))
    _dump(out / "tokenizer_config.json", tokenizer_config())
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
    if "vision_config" in cfg:
        image, video = processor_configs(cfg)
        if max_pixels is not None:
            image["max_pixels"] = max(image["max_pixels"], max_pixels)
            image["size"]["longest_edge"] = image["max_pixels"]
        _dump(out / "preprocessor_config.json", image)
        _dump(out / "video_preprocessor_config.json", video)
