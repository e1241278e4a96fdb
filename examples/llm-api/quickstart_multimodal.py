"""Quickstart: multimodal generation with `tensorrt_llm.LLM` on a Qwen-VL checkpoint.

With no --model_dir it builds (once, then cached) a tiny random demo checkpoint and uses the
bundled demo image, so it runs anywhere, CPU included, in seconds. The demo model's weights
are random: expect gibberish text, the point is the pipeline.

Media and prompts pair up as in TensorRT-LLM's quickstart: N prompts with N media (one each),
or one prompt with all the media (several images in one request). Bad input prints one line
and exits with status 1; --debug shows the traceback.

examples:
    python examples/llm-api/quickstart_multimodal.py
    python examples/llm-api/quickstart_multimodal.py --modality video
    python examples/llm-api/quickstart_multimodal.py --media a.png b.png --prompt "Compare them."
    python examples/llm-api/quickstart_multimodal.py --model_dir /ckpt/Qwen2.5-VL-3B \\
        --modality image --media a.jpg --prompt "What is in this picture?"
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import sys
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops, ImageOps

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.inputs.multimodal_loader import media_per_prompt
from tensorrt_llm.inputs.utils import VideoData, load_image, load_video

MODALITIES = ("image", "video", "multiple_image", "mixture_text_image")
# --model_type values (HF config model_type) -> tiny demo family.
DEMO_FAMILIES = {
    "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
    "qwen3_vl_moe": "qwen3_vl_moe",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
}
DEFAULT_PROMPTS = {
    "image": ["Describe the natural environment in the image."],
    "video": ["Tell me what you see in the video briefly."],
    "multiple_image": ["Describe the difference between the two images."],
    "mixture_text_image": ["Who invented the internet?", "Describe the scene in the image."],
}


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model_dir", default=None, help="local HF checkpoint (default: demo)")
    parser.add_argument("--model_type", default=None, choices=sorted(DEMO_FAMILIES))
    parser.add_argument("--modality", default="image", choices=MODALITIES)
    parser.add_argument(
        "--media",
        nargs="+",
        default=None,
        help="image/video paths or URLs (a video: mp4/webm/mov file or frame folder)",
    )
    parser.add_argument("--prompt", nargs="+", default=None)
    parser.add_argument("--max_tokens", type=int, default=32)
    # None: the checkpoint's generation_config.json decides (greedy when it says do_sample=false).
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top_k", type=int, default=None)
    parser.add_argument("--top_p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max_batch_size", type=int, default=4)
    parser.add_argument("--max_num_tokens", type=int, default=4096)
    parser.add_argument("--max_seq_len", type=int, default=None)
    parser.add_argument("--kv_cache_fraction", type=float, default=0.9)
    parser.add_argument("--enable_chunked_prefill", action="store_true")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--num_frames", type=int, default=4, help="frames of the demo video")
    parser.add_argument(
        "--video_fps",
        type=float,
        default=2.0,
        help="fps of given frames (a video file uses its own timing)",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    return parser


def demo_image() -> Image.Image:
    resource = importlib.resources.files("tensorrt_llm") / "assets" / "demo.png"
    with importlib.resources.as_file(resource) as path:
        return load_image(Path(path))


def demo_video(num_frames: int, fps: float) -> VideoData:
    """A short clip made from the demo image: it slides sideways a few pixels per frame."""
    base = demo_image()
    step = max(base.width // (2 * max(num_frames, 1)), 1)
    frames = [ImageChops.offset(base, i * step, 0) for i in range(num_frames)]
    return VideoData(frames=frames, fps=fps)


def resolve_model(args: argparse.Namespace) -> str:
    if args.model_dir is None:
        from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

        return str(get_or_build_demo_checkpoint(DEMO_FAMILIES[args.model_type or "qwen2_vl"]))
    if args.model_type is not None:
        config = json.loads(_config_file(args.model_dir).read_text(encoding="utf-8"))
        if config.get("model_type") != args.model_type:
            raise SystemExit(
                f"--model_type {args.model_type} does not match the checkpoint's model_type "
                f"{config.get('model_type')!r}"
            )
    _config_file(args.model_dir)
    return args.model_dir


def _config_file(model_dir: str) -> Path:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"--model_dir {model_dir}: no config.json there (not a checkpoint folder)")
    return path


def load_media(args: argparse.Namespace) -> tuple[list[Any], list[Any]]:
    """(images, videos) to use; the bundled demo media when --media is not given."""
    if args.media is None:
        if args.modality == "video":
            return [], [demo_video(args.num_frames, args.video_fps)]
        if args.modality == "multiple_image":
            return [demo_image(), ImageOps.mirror(demo_image())], []
        return [demo_image()], []
    if args.modality == "video":
        return [], [load_video(src, fps=args.video_fps) for src in args.media]
    return [load_image(src) for src in args.media], []


def _media_of_prompts(prompts: list[str], items: list[Any], given: bool) -> list[list[Any]]:
    """Each prompt's media: TensorRT-LLM's pairing for given media (one each, or all for a
    single prompt); the demo's own media is reused for every prompt."""
    if not given:
        return [[items[i % len(items)]] for i in range(len(prompts))]
    return media_per_prompt(prompts, items)


def build_inputs(args: argparse.Namespace, images: list[Any], videos: list[Any]) -> list[Any]:
    """One chat-message input per prompt; media placeholders come from the chat template."""
    prompts = args.prompt or DEFAULT_PROMPTS[args.modality]
    kind = "video" if args.modality == "video" else "image"
    if args.modality in ("multiple_image", "mixture_text_image"):
        per_prompt = [images for _ in prompts]
    else:
        per_prompt = _media_of_prompts(prompts, videos or images, args.media is not None)
    inputs: list[Any] = []
    for i, text in enumerate(prompts):
        if args.modality == "mixture_text_image" and i % 2 == 0:
            media: dict[str, list[Any]] = {}  # even prompts are text-only
        elif args.modality == "mixture_text_image":
            media = {"image": images[:1]}
        else:
            media = {kind: per_prompt[i]}
        parts = [{"type": kind} for kind, items in media.items() for _ in items]
        messages = [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]
        inputs.append({"prompt": messages, "multi_modal_data": media or None})
    return inputs


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    args = add_args(parser).parse_args(argv)
    try:
        return run(args)
    except Exception as exc:  # one clear line for bad input; --debug shows where it came from
        if args.debug:
            raise
        message = str(exc).strip().splitlines()
        print(f"error: {message[0] if message else type(exc).__name__}", file=sys.stderr)
        raise SystemExit(1) from None


def run(args: argparse.Namespace) -> list[str]:
    model = resolve_model(args)
    if args.model_dir is None:
        print(
            "note: the demo checkpoint has random weights, so its text is gibberish; "
            "pass --model_dir for a real model"
        )
    images, videos = load_media(args)
    inputs = build_inputs(args, images, videos)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    texts: list[str] = []
    with LLM(
        model,
        device=args.device,
        max_batch_size=args.max_batch_size,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=args.max_seq_len,
        kv_cache_free_gpu_memory_fraction=args.kv_cache_fraction,
        enable_chunked_prefill=args.enable_chunked_prefill,
        seed=args.seed,
    ) as llm:
        outputs = llm.generate(inputs, params)
        prompts = args.prompt or DEFAULT_PROMPTS[args.modality]
        for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True)):
            text = output.outputs[0].text
            texts.append(text)
            print(f"[{i}] Prompt: {prompt!r}, Generated text: {text!r}")
    return texts


if __name__ == "__main__":
    main(sys.argv[1:])
