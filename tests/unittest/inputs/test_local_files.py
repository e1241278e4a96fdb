"""read_regular_file: only regular files, never blocking, the byte cap enforced while reading."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tensorrt_llm.inputs import local_files
from tensorrt_llm.inputs.local_files import LocalFileError, read_regular_file


def _reason(path: Path, max_bytes: int = 100, inside: Path | None = None) -> str:
    with pytest.raises(LocalFileError) as info:
        read_regular_file(path, max_bytes, inside)
    return info.value.reason


def test_regular_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "a").write_bytes(b"x" * 100)
    assert read_regular_file(tmp_path / "a", 100) == b"x" * 100
    assert _reason(tmp_path / "a", 99) == "too_large"
    assert _reason(tmp_path / "missing") == "not_found"
    assert _reason(tmp_path) == "not_regular"


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_devices_and_fifos_are_refused(tmp_path: Path) -> None:
    assert _reason(Path("/dev/zero")) == "not_regular"  # would never end
    os.mkfifo(tmp_path / "pipe")
    assert _reason(tmp_path / "pipe") == "not_regular"  # would block with no writer


def test_cap_holds_on_bytes_read_not_on_reported_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that grows after fstat (or a size the file system under-reports) is still capped."""
    (tmp_path / "a").write_bytes(b"x" * 500)
    real_fstat = os.fstat

    class _Small:
        def __init__(self, info: os.stat_result) -> None:
            self.st_mode, self.st_size = info.st_mode, 1

    monkeypatch.setattr(local_files.os, "fstat", lambda fd: _Small(real_fstat(fd)))
    assert _reason(tmp_path / "a", 100) == "too_large"


def test_opened_file_must_stay_inside(tmp_path: Path) -> None:
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    os.symlink(outside / "secret", inside / "link")
    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc to name an open descriptor")
    assert _reason(inside / "link", inside=inside) == "bad_path"
