"""`profiled`: the TRTLLM_BENCH_PROFILE hook appends op tables per wave, and is a no-op unset."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tensorrt_llm.bench.profile_env import PROFILE_ENV, profiled


def _matmul() -> torch.Tensor:
    a = torch.randn(32, 32)
    return a @ a


def test_profiled_appends_tables_per_wave(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    out = tmp_path / "profile.txt"
    monkeypatch.setenv(PROFILE_ENV, str(out))
    for _ in range(2):
        with profiled("x"):
            _matmul()
    text = out.read_text(encoding="utf-8")
    assert text.count("== x ==") == 2
    assert "aten::mm" in text


def test_profiled_unset_is_a_no_op(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(PROFILE_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    ran = []
    with profiled("x"):
        ran.append(_matmul())
    assert len(ran) == 1
    assert list(tmp_path.iterdir()) == []
