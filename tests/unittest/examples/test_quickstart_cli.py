"""The multimodal quickstart from a shell: all given media used, one clear line and exit
status 1 for bad input (no traceback unless --debug), examples in --help on their own lines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tensorrt_llm

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "examples" / "llm-api" / "quickstart_multimodal.py"
IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--max_tokens", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def test_one_prompt_takes_every_given_image() -> None:
    done = _run("--media", IMAGE, IMAGE, "--prompt", "Compare them.")
    assert done.returncode == 0, done.stderr
    assert "[0] Prompt: 'Compare them.'" in done.stdout and "[1]" not in done.stdout
    assert "random weights" in done.stdout  # the demo says its text is gibberish


@pytest.mark.parametrize(
    "args, message",
    [
        (("--media", "/no/such/image.png"), "error: image string is not an existing file"),
        (("--media", "BAD"), "error: "),
        (("--model_dir", "/"), "error: --model_dir /: no config.json there"),
        (("--max_tokens", "0"), "error: max_tokens must be an int >= 1"),
        (("--media", IMAGE, IMAGE, "--prompt", "a", "b", "c"), "error: 3 prompts but 2 media"),
    ],
)
def test_bad_input_is_one_line_and_status_1(tmp_path: Path, args: tuple, message: str) -> None:
    if args == ("--media", "BAD"):
        (tmp_path / "bad.png").write_bytes(b"not an image")
        args = ("--media", str(tmp_path / "bad.png"))
    done = _run(*args)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(message), done.stderr


def test_debug_shows_the_traceback() -> None:
    done = _run("--media", "/no/such/image.png", "--debug")
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_help_lists_examples_on_their_own_lines() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0
    lines = done.stdout.splitlines()
    assert "examples:" in lines
    assert any(
        line.strip().startswith("python examples/llm-api/quickstart_multimodal.py --media")
        for line in lines
    )


def test_a_video_file(tmp_path: Path) -> None:
    av = pytest.importorskip("av")
    import numpy as np

    clip = tmp_path / "clip.mp4"
    with av.open(str(clip), "w") as container:
        stream = container.add_stream("libx264", rate=4)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for i in range(8):
            frame = av.VideoFrame.from_ndarray(np.full((64, 64, 3), 30 * i, np.uint8), "rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    done = _run("--modality", "video", "--media", str(clip))
    assert done.returncode == 0, done.stderr
    assert "[0] Prompt: 'Tell me what you see in the video briefly.'" in done.stdout
