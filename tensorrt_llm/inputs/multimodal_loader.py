"""Plain prompts with media: the chat message that places one placeholder per item, and
`default_multimodal_input_loader` under TensorRT-LLM's name and signature.

A string prompt that carries media but no placeholder at all is what a newcomer writes
(`{"prompt": "Describe the image.", "multi_modal_data": {"image": [...]}}`): it is rendered as
one user message holding the media items first, then the text, through the checkpoint's chat
template, as the Qwen model cards show. A prompt with some placeholders keeps them and must
have one per item.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .chat_tokenize import render_chat
from .data import ChatMessage
from .registry import load_tokenizer

# The modalities a `default_multimodal_input_loader` call may name, and what each means.
_LOADER_MODALITIES = ("image", "video", "multiple_image")
# Qwen-VL `model_type`s this project serves (config.json), accepted as `model_type`.
QWEN_VL_MODEL_TYPES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
)


def media_message(text: str, num_images: int = 0, num_videos: int = 0) -> list[ChatMessage]:
    """One user message: the media placeholders (images, then videos), then `text`."""
    content: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    content += [{"type": "video"} for _ in range(num_videos)]
    content.append({"type": "text", "text": text})
    return [{"role": "user", "content": content}]


def media_per_prompt(
    prompts: Sequence[str], media: Sequence[Any] | None, modality: str = "image"
) -> list[list[Any]]:
    """The media items of each prompt: one item (or list) per prompt, or every item for a
    single prompt (TensorRT-LLM's "1 prompt, N media" mode)."""
    if media is None:
        return [[] for _ in prompts]
    items = list(media)
    if len(prompts) == 1 and (len(items) != 1 or modality == "multiple_image"):
        flat = items[0] if len(items) == 1 and isinstance(items[0], list | tuple) else items
        return [list(flat)]
    if len(items) != len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts but {len(items)} media entries: give one entry (an item or "
            f"a list of items) per prompt, or one prompt for all of them"
        )
    return [list(m) if isinstance(m, list | tuple) else [m] for m in items]


def default_multimodal_input_loader(
    *,
    tokenizer: Any | None,
    model_dir: str,
    model_type: str,
    modality: str,
    prompts: list[str],
    media: list[Any] | list[list[Any]] | None = None,
    image_data_format: str = "pt",
    num_frames: int = 8,
    mm_embeddings: list[Any] | None = None,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    """Inputs for `LLM.generate`: per prompt, the chat-templated text with one placeholder
    per media item and its `multi_modal_data`.

    The media items are passed on as given (paths, URLs, PIL images, tensors, frame lists);
    the model's input processor loads and preprocesses them on the host, so `image_data_format`
    ("pt" or "pil") and `device` change nothing here. `num_frames` becomes the videos'
    `mm_processor_kwargs`. Precomputed `mm_embeddings` are not supported.
    """
    if mm_embeddings is not None:
        raise ValueError("mm_embeddings are not supported: pass the media items in `media`")
    if model_type not in QWEN_VL_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not served here; supported: {QWEN_VL_MODEL_TYPES}"
        )
    if modality not in _LOADER_MODALITIES:
        raise ValueError(f"modality {modality!r} is not supported; supported: {_LOADER_MODALITIES}")
    if image_data_format not in ("pt", "pil"):
        raise ValueError(f"image_data_format must be 'pt' or 'pil', got {image_data_format!r}")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if isinstance(prompts, str) or not prompts:
        raise ValueError("prompts must be a non-empty list of strings")
    if tokenizer is None:
        tokenizer = load_tokenizer(model_dir)
    kind = "video" if modality == "video" else "image"
    out: list[dict[str, Any]] = []
    for text, items in zip(prompts, media_per_prompt(prompts, media, modality), strict=True):
        counts = {"num_videos": len(items)} if kind == "video" else {"num_images": len(items)}
        entry: dict[str, Any] = {"prompt": render_chat(tokenizer, media_message(text, **counts))}
        if items:
            entry["multi_modal_data"] = {kind: items}
            if kind == "video":
                entry["mm_processor_kwargs"] = {"num_frames": num_frames}
        out.append(entry)
    return out
