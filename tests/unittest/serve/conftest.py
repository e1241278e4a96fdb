"""Fixtures of the serve tests: one real server (tiny demo checkpoint, CPU) per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_helpers import ServeHandle, png_bytes, start_server

# Small limits keep every test fast on a 2-core CPU; max_seq_len leaves room for a
# long-running stream (the disconnect tests) and for a "prompt too long" case.
MAX_SEQ_LEN = 512
IMAGE_LIMIT = 2


@pytest.fixture(scope="session")
def media_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("allowed_media")
    (root / "red.png").write_bytes(png_bytes(color=(220, 20, 20)))
    frames = root / "clip"
    frames.mkdir()
    for i in range(4):
        (frames / f"{i:03d}.png").write_bytes(png_bytes(size=(56, 56), color=(50 * i, 90, 10)))
    return root


@pytest.fixture(scope="session")
def served(media_root: Path) -> Iterator[ServeHandle]:
    handle = start_server(
        [
            "--demo",
            "--device",
            "cpu",
            "--max_seq_len",
            str(MAX_SEQ_LEN),
            "--limit_mm_per_prompt",
            f'{{"image": {IMAGE_LIMIT}}}',
            "--allowed_local_media_path",
            str(media_root),
            "--media_fetch_timeout",
            "2",
        ]
    )
    try:
        yield handle
    finally:
        handle.stop()
