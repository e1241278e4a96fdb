"""trtllm-bench in upstream's shape: prepare-dataset, throughput --dataset, --plot, on CPU."""

from __future__ import annotations

import builtins
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.bench.dataset import load_dataset, to_request
from tensorrt_llm.bench.upstream_cli import is_upstream_form
from tensorrt_llm.commands.bench import main
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict, write_tiny_checkpoint

_HAS_MPL = importlib.util.find_spec("matplotlib") is not None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("qwen3_vl", tmp_path_factory.mktemp("ckpt") / "qwen3_vl")


def _prepare(ckpt: Path, out: Path, *extra: str) -> None:
    argv = ["--model", str(ckpt), "prepare-dataset", "--output", str(out), "token-norm-dist",
            "--num-requests", "3", "--input-mean", "12", "--output-mean", "4",
            "--image-size", "32", *extra]  # fmt: skip
    assert main(argv) == 0


def test_prepare_dataset_lines(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "d" / "data.jsonl"
    _prepare(ckpt, out, "--images-per-request", "2", "--output-stdev", "2")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    config = load_pretrained_config(ckpt)
    assert [line["task_id"] for line in lines] == [0, 1, 2]
    for line in lines:
        assert set(line) == {"task_id", "input_ids", "output_tokens", "media_paths"}
        assert len(line["input_ids"]) == 12 and line["output_tokens"] >= 1
        assert config.image_token_id not in line["input_ids"]
        # Relative paths, resolved from the dataset's folder, so the folder can move.
        assert all((out.parent / m).is_file() for m in line["media_paths"])
        assert len(line["media_paths"]) == 2
    entries = load_dataset(out)
    assert [e.images[0].size for e in entries] == [(32, 32)] * 3
    req = to_request(entries[0], config)
    block = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    assert req["prompt_token_ids"] == block * 2 + lines[0]["input_ids"]
    assert len(req["multi_modal_data"]["image"]) == 2


def test_dataset_data_urls_and_text_prompts(ckpt: Path, tmp_path: Path) -> None:
    out = tmp_path / "data.jsonl"
    _prepare(ckpt, out, "--image-format", "data_url")
    url = json.loads(out.read_text().splitlines()[0])["media_paths"][0]
    assert url.startswith("data:image/png;base64,")
    text = tmp_path / "text.jsonl"
    text.write_text(
        json.dumps({"prompt": "Describe it.", "output_tokens": 2, "media_paths": [url]})
    )
    (entry,) = load_dataset(text)
    req = to_request(entry, load_pretrained_config(ckpt))
    assert req["prompt"] == "Describe it." and len(req["multi_modal_data"]["image"]) == 1


@pytest.mark.parametrize(
    "line, match",
    [
        ({"prompt": "a", "input_ids": [1], "output_tokens": 1}, "exactly one"),
        ({"prompt": "a"}, "output_tokens"),
        ({"input_ids": [], "output_tokens": 1}, "non-empty"),
        ({"prompt": "a", "output_tokens": 1, "logits": 1}, "unsupported fields"),
        ({"prompt": "a", "output_tokens": 1, "media_paths": ["missing.png"]}, "missing.png"),
    ],
)
def test_bad_dataset_lines_are_rejected(tmp_path: Path, line: dict[str, Any], match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(line) + "\n")
    with pytest.raises(ValueError, match=match):
        load_dataset(path)


def test_subcommand_detection() -> None:
    assert is_upstream_form(["--model", "m", "throughput", "--dataset", "d"])
    assert not is_upstream_form(["--config", "c.json", "--concurrency", "2"])


def _throughput(ckpt: Path, dataset: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(ckpt), "throughput", "--dataset", str(dataset), "--concurrency",
            "1", "2", "--dtype", "float32", "--device", "cpu", "--report_json", str(out),
            "--warmup", "1", *extra]  # fmt: skip


def test_throughput_on_demo_checkpoint(ckpt: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.jsonl"
    _prepare(ckpt, dataset)
    out = tmp_path / "result.json"
    assert main(_throughput(ckpt, dataset, out)) == 0
    rows = json.loads(out.read_text())["ours"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for row in rows:
        # ignore_eos: every request yields its output_tokens (4 each, stdev 0).
        assert row["requests"] == 3 and row["output_tokens"] == 12
        assert row["output_tok_s"] > 0 and row["ttft_ms_p50"] > 0


def test_throughput_random_weights_with_hf_baseline(ckpt: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.jsonl"
    _prepare(ckpt, dataset)
    out = tmp_path / "result.json"
    argv = _throughput(ckpt, dataset, out, "--load_format", "dummy", "--hf_baseline",
                       "--hf_max_osl", "8")  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert [r["concurrency"] for r in result["hf"]] == [1, 2]
    assert [r["concurrency"] for r in result["ratios"]] == [1, 2]
    assert all(r["throughput_ratio"] > 0 for r in result["ratios"])


def test_hf_baseline_needs_one_prompt_length(ckpt: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.jsonl"
    _prepare(ckpt, dataset, "--input-stdev", "4")
    argv = _throughput(ckpt, dataset, tmp_path / "r.json", "--hf_baseline")
    with pytest.raises(SystemExit, match="one length"):
        main(argv)


def test_throughput_plot(ckpt: Path, tmp_path: Path) -> None:
    dataset = tmp_path / "data.jsonl"
    _prepare(ckpt, dataset)
    out, png = tmp_path / "result.json", tmp_path / "plot.png"
    argv = _throughput(ckpt, dataset, out, "--plot", str(png))
    if not _HAS_MPL:
        with pytest.raises(SystemExit, match=r"tensorrt-llm-qwenvl\[plot\]"):
            main(argv)
        assert not out.exists()  # it failed before any wave ran
        pytest.skip("matplotlib is not installed: the clear error is checked, not the file")
    assert main(argv) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_error_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib (hidden here when it is installed) --plot stops with the extra."""
    from tensorrt_llm.bench.plot import require_matplotlib

    real_import = builtins.__import__

    def no_matplotlib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match=r"pip install 'tensorrt-llm-qwenvl\[plot\]'"):
        require_matplotlib()


def test_old_form_plot_fails_before_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tensorrt_llm.commands.bench as bench

    def boom(*args: Any, **kwargs: Any) -> None:
        raise SystemExit("--plot needs matplotlib (stand-in)")

    monkeypatch.setattr(bench, "require_matplotlib", boom)
    ran: list[bool] = []
    monkeypatch.setattr(bench, "_main", lambda *a: ran.append(True) or 0)
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(build_config_dict("qwen3_vl")))
    with pytest.raises(SystemExit, match="stand-in"):
        main(["--config", str(config), "--plot", str(tmp_path / "p.png")])
    assert ran == []


@pytest.mark.skipif(not _HAS_MPL, reason="matplotlib (the plot extra) is not installed")
def test_plot_file_from_rows(tmp_path: Path) -> None:
    from tensorrt_llm.bench.plot import plot_results

    ours = [{"concurrency": c, "output_tok_s": 10.0 * c, "ttft_ms_p50": 5.0, "itl_ms_p50": 1.0}
            for c in (1, 4)]  # fmt: skip
    hf = [{"concurrency": 1, "output_tok_s": 2.0, "ttft_ms": 9.0, "itl_ms": 3.0}]
    path = plot_results(tmp_path / "p.png", {"ours": ours}, hf)
    assert path.stat().st_size > 1000


def test_hf_baseline_stamps_every_token(ckpt: Path) -> None:
    """One generate call, one stamp per token: the decode step is positive by construction."""
    import torch

    from tensorrt_llm.bench.hf_baseline import _generate_stamps, build_hf_model

    config = load_pretrained_config(ckpt)
    model = build_hf_model(config, torch.float32, "cpu")
    ids = torch.tensor([[5, 6, 7, 8]])
    start, stamps = _generate_stamps(model, {"input_ids": ids}, 5)
    assert len(stamps) == 5
    assert start < stamps[0] and stamps == sorted(stamps)


def test_wave_progress_bar_counts_every_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_requests ticks its bar once per finished request and keeps per-request params."""
    import io
    from types import SimpleNamespace

    from tqdm import tqdm

    import tensorrt_llm.bench.runner as runner
    from tensorrt_llm.sampling_params import SamplingParams

    class FakeLLM:
        async def generate_async(self, prompt: Any, params: SamplingParams, streaming: bool):
            for n in range(1, params.max_tokens + 1):
                completion = SimpleNamespace(token_ids=list(range(n)))
                yield SimpleNamespace(outputs=[completion], metrics=None)

    bars: list[Any] = []
    assert runner.wave_bar(3, 2).disable  # off where stderr is no terminal (as under pytest)

    def recording_bar(total: int, concurrency: int) -> Any:
        bars.append(tqdm(total=total, file=io.StringIO(), disable=False))
        return bars[-1]

    monkeypatch.setattr(runner, "wave_bar", recording_bar)
    params = [SamplingParams(max_tokens=n, detokenize=False) for n in (2, 3, 5)]
    row = runner.run_requests(FakeLLM(), [{}, {}, {}], params, concurrency=2)
    assert row["output_tokens"] == 10 and row["requests"] == 3
    assert bars[0].n == 3 and bars[0].total == 3


def test_throughput_text_prompts_with_data_url_images(ckpt: Path, tmp_path: Path) -> None:
    """Text prompts without placeholders are chat-templated with their images in front."""
    images = tmp_path / "img.jsonl"
    _prepare(ckpt, images, "--image-format", "data_url")
    url = json.loads(images.read_text().splitlines()[0])["media_paths"][0]
    dataset = tmp_path / "text.jsonl"
    lines = [{"prompt": f"Describe picture {i}.", "output_tokens": 3, "media_paths": [url]}
             for i in range(2)]  # fmt: skip
    dataset.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "result.json"
    argv = ["--model", str(ckpt), "throughput", "--dataset", str(dataset), "--dtype", "float32",
            "--device", "cpu", "--report_json", str(out), "--warmup", "0"]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["ours"]
    assert row["concurrency"] == 2 and row["requests"] == 2 and row["output_tokens"] == 6
