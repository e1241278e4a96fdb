"""Benchmark workloads: a model folder for a real-size config, and the image+text requests."""

from __future__ import annotations

import itertools
import json
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..tools.tiny_tokenizer import SPECIAL_IDS, write_processing_files


@dataclass(frozen=True)
class Workload:
    isl: int  # prompt tokens per request, vision tokens included
    osl: int  # output tokens per request
    images_per_request: int
    image_size: int  # square images of image_size x image_size pixels
    num_requests: int
    ignore_eos: bool = True
    seed: int = 0
    guided_json: str | None = None  # a JSON schema every output must follow (--guided_json)


def prepare_model_folder(config_path: str | Path, out_dir: str | Path, image_size: int) -> Path:
    """A checkpoint folder without weights: the real-size config plus tokenizer/processor files.

    The model runs with `load_format="dummy"` (random weights). In-process prompts are token
    ids; served prompts are text, sized with the tiny tokenizer, whose vocab is stretched to the
    model's (`cover_vocab`) so that every sampled id streams back as text.
    """
    cfg = json.loads(Path(config_path).read_text(encoding="utf-8"))
    # The folder carries the tiny tokenizer, so the special ids follow it. With random weights
    # the ids carry no meaning; only the token counts shape the workload.
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        if key in cfg:
            cfg[key] = SPECIAL_IDS[token]
    text = cfg.get("text_config", cfg)
    text["bos_token_id"] = text["pad_token_id"] = SPECIAL_IDS["<|endoftext|>"]
    text["eos_token_id"] = SPECIAL_IDS["<|im_end|>"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    write_processing_files(out, cfg, max_pixels=image_size * image_size)
    cover_vocab(out / "tokenizer.json", int(text["vocab_size"]))
    return out


def cover_vocab(tokenizer_json: Path, vocab_size: int) -> None:
    """Give every id below `vocab_size` a word of its own in the tokenizer's BPE vocab.

    A random-weight model samples ids across the real vocab, but the tiny tokenizer knows ~400;
    the rest would decode to nothing, so a served stream would carry almost no text chunks (no
    TTFT/ITL to measure) and the server's detokenizer would do no real work. The added words
    ("Ġaaaa", ...) decode to " aaaa" etc.; no merge produces them, so encoding is unchanged.
    """
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    # NOTE: the special tokens enter the model vocab at their own ids. Without them the vocab
    # would have a hole at 400..406, and transformers, seeing fewer entries than the highest
    # id, re-adds the specials after the end: the placeholders would no longer match config.
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    taken = set(vocab.values())
    free = (i for i in range(vocab_size) if i not in taken)
    words = ("\u0120" + "".join(p) for p in itertools.product(string.ascii_lowercase, repeat=4))
    for token_id in free:
        word = next(words)
        while word in vocab:
            word = next(words)
        vocab[word] = token_id
    tokenizer_json.write_text(json.dumps(data), encoding="utf-8")


def vision_tokens_per_image(config: Any, image_size: int) -> int:
    vision = config.vision_config
    patches = image_size // vision.patch_size
    return patches * patches // vision.spatial_merge_size**2


def make_requests(config: Any, workload: Workload) -> list[dict[str, Any]]:
    """Token-id prompts: n image blocks, then random text filling the prompt to `isl` tokens."""
    rng = np.random.default_rng(workload.seed)
    # Text ids stay below every special id, so random text never forms a vision placeholder.
    specials = (config.vision_start_token_id, config.image_token_id, config.video_token_id)
    vocab = min(int(config.text_config.vocab_size), *specials)
    per_image = vision_tokens_per_image(config, workload.image_size) + 2  # + start/end tokens
    num_text = workload.isl - workload.images_per_request * per_image
    if num_text < 1:
        raise ValueError(
            f"isl {workload.isl} leaves no room for text after {workload.images_per_request} "
            f"images of {per_image} tokens"
        )
    block = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    size = workload.image_size
    requests = []
    for _ in range(workload.num_requests):
        images = [
            Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
            for _ in range(workload.images_per_request)
        ]
        text = rng.integers(0, vocab, num_text).tolist()
        ids = block * workload.images_per_request + text
        media = {"image": images} if images else {}
        requests.append({"prompt_token_ids": ids, "multi_modal_data": media})
    return requests
