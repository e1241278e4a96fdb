"""Bucketed autotune keys and the on-disk cache of tuned configs (real Triton Autotuners,
never launched: the tests fill their result dicts as a benchmark would)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")

from tensorrt_llm._torch.triton_autotune import (  # noqa: E402
    AutotuneDiskCache,
    bucket_dim,
    find_autotuners,
    fingerprint,
    install_bucketed_caches,
)

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32) for w in (2, 4)]


def _make_tuner() -> Any:
    """A fresh autotuned kernel keyed on a head count H and a token count T."""

    def kernel(x, T, H, BLOCK: triton.language.constexpr):  # type: ignore[no-untyped-def]
        pass

    return triton.autotune(configs=list(CONFIGS), key=["H", "T"])(triton.jit(kernel))


def _fake_module(name: str, tuner: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__["kernel"] = triton.heuristics({"X": lambda args: 1})(tuner)
    return module


@pytest.fixture
def tuners(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setitem(sys.modules, "fakefla.ops", _fake_module("fakefla.ops", _make_tuner()))
    found = find_autotuners(("fakefla.",))
    assert len(found) == 1  # found through the heuristics wrapper
    return found


def test_bucket_dim() -> None:
    assert [bucket_dim(v) for v in (0, 1, 2, 3, 5, 1000, 1024)] == [0, 1, 2, 4, 8, 1024, 1024]
    assert bucket_dim("torch.bfloat16") == "torch.bfloat16" and bucket_dim(True) is True


def test_bucketed_cache_shares_a_bucket_and_reports_new_keys(tuners: dict[str, Any]) -> None:
    caches = install_bucketed_caches(tuners)
    (name, cache), tuner = next(iter(caches.items())), next(iter(tuners.values()))
    assert tuner.cache is cache and cache.positions == {1}  # T; H stays exact
    seen: list[tuple[str, tuple]] = []
    cache.on_new_key = lambda kernel, key: seen.append((kernel, key))
    cache[(8, 1000, "torch.bfloat16")] = CONFIGS[3]  # what Autotuner.run does after benching
    assert (8, 600, "torch.bfloat16") in cache and cache[(8, 1024, "torch.bfloat16")] is CONFIGS[3]
    assert (8, 400, "torch.bfloat16") not in cache and (4, 1000, "torch.bfloat16") not in cache
    cache[(8, 700, "torch.bfloat16")] = CONFIGS[3]  # same bucket: not a new benchmark
    assert seen == [(name, (8, 1024, "torch.bfloat16"))] and cache.num_benchmarked == 1
    assert install_bucketed_caches(tuners)[name] is cache  # idempotent


def _disk(tmp_path: Path, gpu: str = "NVIDIA H200", cap: tuple[int, int] = (9, 0)) -> Any:
    return AutotuneDiskCache(tmp_path, fingerprint(gpu, cap))


def test_disk_cache_round_trip_into_a_fresh_autotuner(
    tuners: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches = install_bucketed_caches(tuners)
    name = next(iter(caches))
    caches[name][(8, 300, "torch.float16")] = CONFIGS[2]
    assert _disk(tmp_path).save_from(caches) == 1
    # A second start: a new process has a new Autotuner object with an empty cache.
    monkeypatch.setitem(sys.modules, "fakefla.ops", _fake_module("fakefla.ops", _make_tuner()))
    fresh = find_autotuners(("fakefla.",))
    fresh_caches = install_bucketed_caches(fresh)
    assert _disk(tmp_path).load_into(fresh, fresh_caches) == 1
    config = fresh_caches[name][(8, 257, "torch.float16")]
    assert config is fresh[name].configs[2]  # the kernel's own Config object (pre_hooks kept)
    assert fresh_caches[name].num_benchmarked == 0  # loaded, not benchmarked


def test_disk_cache_key_changes_with_gpu_and_versions(
    tuners: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _disk(tmp_path)
    assert _disk(tmp_path, gpu="NVIDIA H100 80GB HBM3").path != base.path
    assert _disk(tmp_path, cap=(10, 0)).path != base.path
    monkeypatch.setattr(triton, "__version__", "9.9.9")
    assert _disk(tmp_path).path != base.path
    monkeypatch.undo()
    import torch

    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert _disk(tmp_path).path != base.path
    monkeypatch.undo()
    assert _disk(tmp_path).path == base.path


def test_disk_cache_skips_foreign_or_stale_entries(tuners: dict[str, Any], tmp_path: Path) -> None:
    caches = install_bucketed_caches(tuners)
    name = next(iter(caches))
    disk = _disk(tmp_path)
    caches[name][(8, 64, "torch.float16")] = CONFIGS[0]
    disk.save_from(caches)
    data = json.loads(disk.path.read_text())
    # A config the kernel no longer lists (fla changed its configs) is not loaded.
    data["kernels"][name][0][1]["num_warps"] = 16
    disk.path.write_text(json.dumps(data))
    fresh = install_bucketed_caches(tuners)
    fresh[name].clear()
    assert disk.load_into(tuners, fresh) == 0
    # A file of another fingerprint under the same name is ignored, not trusted.
    data["fingerprint"]["gpu"] = "other"
    disk.path.write_text(json.dumps(data))
    assert disk.load_into(tuners, fresh) == 0
    disk.path.write_text("{torn")
    assert disk.load_into(tuners, fresh) == 0


def test_disk_cache_leaves_out_keys_json_cannot_hold(
    tuners: dict[str, Any], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caches = install_bucketed_caches(tuners)
    name = next(iter(caches))
    caches[name][(8, 64, "torch.float16")] = CONFIGS[0]
    caches[name][(8, (1, 2), "torch.float16")] = CONFIGS[1]  # a tuple would read back a list
    assert _disk(tmp_path).save_from(caches) == 1
    assert "not storable" in caplog.text


def test_startup_tuning_counts_from_begin_and_a_second_start_reads_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """StartupTuning, as create_py_executor uses it: begun before the probe, so a tune there
    is counted and saved; the next process's begin loads it and tunes nothing."""
    import torch

    from tensorrt_llm._torch.pyexecutor.warmup import StartupTuning

    def start() -> tuple[StartupTuning, Any]:
        tuner = _make_tuner()  # a new process: a new Autotuner with an empty cache
        monkeypatch.setitem(sys.modules, "fla.fake_ops", _fake_module("fla.fake_ops", tuner))
        return StartupTuning.begin(torch.device("cpu"), _disk(tmp_path)), tuner

    first, tuner = start()
    assert first.configs_loaded == 0
    tuner.cache[(8, 100, "torch.bfloat16")] = CONFIGS[1]  # the probe's first call benchmarks
    assert first.counts()[1] == 1
    first.save()
    second, tuner = start()
    assert second.configs_loaded == 1
    assert (8, 90, "torch.bfloat16") in tuner.cache  # Autotuner.run finds it: no benchmark
    assert second.counts()[1] == 0
