"""trtllm-bench datasets: the JSON-lines file of upstream's `prepare-dataset` / `--dataset`.

One request per line, upstream's field names:

    {"task_id": 0, "input_ids": [..], "output_tokens": 128, "media_paths": ["img0.png"]}
    {"task_id": 1, "prompt": "Describe the image.", "output_tokens": 64,
     "media_paths": ["data:image/png;base64,..."]}

`prompt` (text) or `input_ids` (token ids), exactly one of them. `media_paths` holds images as
file paths (relative ones are taken from the dataset's folder) or data URLs. Images go before
the text, as the Qwen chat template places them: a text prompt without placeholders is templated
by the LLM API; token ids without an image placeholder get one vision block per image in front.
"""

from __future__ import annotations

import base64
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from ..inputs.utils import load_image
from ..sampling_params import SamplingParams

_FIELDS = {"task_id", "prompt", "input_ids", "output_tokens", "media_paths"}
IMAGE_FORMATS = ("path", "data_url")


@dataclass
class DatasetEntry:
    task_id: int
    output_tokens: int
    prompt: str | None = None
    input_ids: list[int] | None = None
    images: list[Image.Image] = field(default_factory=list)


def _check_line(obj: Any, where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a line must be a JSON object, got {type(obj).__name__}")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unsupported fields {sorted(unknown)}; known: {sorted(_FIELDS)}")
    if ("prompt" in obj) == ("input_ids" in obj):
        raise ValueError(f"{where}: give exactly one of 'prompt' (text) and 'input_ids'")
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise ValueError(f"{where}: 'prompt' must be a string")
    ids = obj.get("input_ids")
    if ids is not None and (
        not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids)
    ):
        raise ValueError(f"{where}: 'input_ids' must be a non-empty list of token ids")
    out = obj.get("output_tokens")
    if type(out) is not int or out < 1:
        raise ValueError(f"{where}: 'output_tokens' must be a positive integer, got {out!r}")
    media = obj.get("media_paths", [])
    if not isinstance(media, list) or not all(isinstance(m, str) for m in media):
        raise ValueError(f"{where}: 'media_paths' must be a list of paths or data URLs")


def _open_media(src: str, folder: Path, where: str) -> Image.Image:
    if src.startswith(("data:", "http://", "https://")):
        return load_image(src)
    path = Path(src) if Path(src).is_absolute() else folder / src
    if not path.is_file():
        raise ValueError(f"{where}: media file not found: {path}")
    return load_image(path)


def load_dataset(path: str | Path, num_requests: int | None = None) -> list[DatasetEntry]:
    """The dataset's requests (the first `num_requests`), images decoded up front so that file
    reads stay out of the timings."""
    path = Path(path)
    entries: list[DatasetEntry] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if num_requests is not None and len(entries) >= num_requests:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON: {exc}") from None
            _check_line(obj, where)
            entries.append(
                DatasetEntry(
                    task_id=int(obj.get("task_id", len(entries))),
                    output_tokens=obj["output_tokens"],
                    prompt=obj.get("prompt"),
                    input_ids=obj.get("input_ids"),
                    images=[_open_media(m, path.parent, where) for m in obj.get("media_paths", [])],
                )
            )
    if not entries:
        raise ValueError(f"{path}: the dataset holds no requests")
    if num_requests is not None and len(entries) < num_requests:
        raise ValueError(
            f"{path}: --num_requests {num_requests} but the dataset has {len(entries)}"
        )
    return entries


def to_request(entry: DatasetEntry, config: Any) -> dict[str, Any]:
    """The LLM API prompt of one entry (see the module docstring for where images go)."""
    media = {"image": list(entry.images)} if entry.images else {}
    if entry.prompt is not None:
        return {"prompt": entry.prompt, "multi_modal_data": media}
    ids = list(entry.input_ids or [])
    if entry.images and config.image_token_id not in ids:
        block = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
        ids = block * len(entry.images) + ids
    return {"prompt_token_ids": ids, "multi_modal_data": media}


def to_sampling_params(entry: DatasetEntry, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=entry.output_tokens, temperature=0.0, ignore_eos=ignore_eos, detokenize=False
    )


def _lengths(rng: np.random.Generator, n: int, mean: int, stdev: int) -> list[int]:
    # Normal lengths as upstream's token-norm-dist, clipped to at least one token.
    if mean < 1 or stdev < 0:
        raise ValueError(f"lengths need mean >= 1 and stdev >= 0, got {mean} and {stdev}")
    draws = rng.normal(mean, stdev, n) if stdev else np.full(n, mean)
    return [max(1, round(float(x))) for x in draws]


def _png_data_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def write_synthetic_dataset(
    config: Any,
    output: str | Path,
    num_requests: int,
    input_mean: int,
    output_mean: int,
    input_stdev: int = 0,
    output_stdev: int = 0,
    images_per_request: int = 1,
    image_size: int = 512,
    image_format: str = "path",
    seed: int = 0,
) -> Path:
    """Random image+text requests: `input_*` text tokens (the images' vision tokens come on top),
    `output_*` tokens, `images_per_request` noise images of `image_size` pixels square, stored
    as PNG files beside the dataset (`<stem>_images/`) or inline as data URLs."""
    if num_requests < 1 or images_per_request < 0 or image_size < 1:
        raise ValueError("need num_requests >= 1, images_per_request >= 0 and image_size >= 1")
    if image_format not in IMAGE_FORMATS:
        raise ValueError(f"image_format must be one of {IMAGE_FORMATS}, got {image_format!r}")
    out = Path(output)
    out.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    # Text ids stay below every special id, so random text never forms a vision placeholder.
    specials = [
        getattr(config, k, None)
        for k in ("vision_start_token_id", "image_token_id", "video_token_id")
    ]
    vocab = min(int(config.text_config.vocab_size), *(s for s in specials if s is not None))
    in_lens = _lengths(rng, num_requests, input_mean, input_stdev)
    out_lens = _lengths(rng, num_requests, output_mean, output_stdev)
    image_dir = out.parent / f"{out.stem}_images"
    lines = []
    for i in range(num_requests):
        media = []
        for k in range(images_per_request):
            pixels = rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8)
            image = Image.fromarray(pixels)
            if image_format == "data_url":
                media.append(_png_data_url(image))
            else:
                image_dir.mkdir(exist_ok=True)
                name = image_dir / f"task{i}_{k}.png"
                image.save(name)
                media.append(str(name.relative_to(out.parent)))
        line: dict[str, Any] = {
            "task_id": i,
            "input_ids": rng.integers(0, vocab, in_lens[i]).tolist(),
            "output_tokens": out_lens[i],
        }
        if media:
            line["media_paths"] = media
        lines.append(json.dumps(line))
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out
