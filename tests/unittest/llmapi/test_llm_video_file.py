"""The LLM API generates from a video file exactly as from the same frames given decoded."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from tensorrt_llm.inputs.utils import video_file_data as decode_video_file
from tensorrt_llm.llmapi.llm import LLM
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import get_or_build_demo_checkpoint

av = pytest.importorskip("av")


def write_video(num_frames: int, fps: int, size: tuple[int, int]) -> bytes:
    """An mp4 of random frames at `fps`, encoded by PyAV."""
    if "libx264" not in av.codecs_available:
        pytest.skip("libx264 encoder not available")
    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(num_frames):
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _prompt(video: object) -> dict[str, object]:
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "hi"}]}]
    return {"prompt": messages, "multi_modal_data": {"video": [video]}}


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen3_vl"])
def test_generate_from_video_file(family: str, tmp_path: Path) -> None:
    data = write_video(4, 2, size=(56, 56))
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(data)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    ckpt = get_or_build_demo_checkpoint(family)
    with LLM(str(ckpt), max_batch_size=2, max_seq_len=512, kv_cache_max_tokens=2048) as llm:
        from_file = llm.generate(_prompt(str(clip)), greedy)
        reference = llm.generate(_prompt(decode_video_file(data)), greedy)
    assert from_file.outputs[0].token_ids == reference.outputs[0].token_ids
    assert len(from_file.outputs[0].token_ids) == 4
