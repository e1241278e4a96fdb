"""trtllm-bench pieces: workload shapes, timing summary, and a tiny end-to-end run on CPU."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.bench.metrics import RequestTiming, summarize
from tensorrt_llm.bench.workload import (
    Workload,
    make_requests,
    prepare_model_folder,
    vision_tokens_per_image,
)
from tensorrt_llm.commands.bench import main
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(build_config_dict("qwen3_vl")))
    return path


def test_requests_have_isl_tokens_and_no_stray_placeholders(
    tiny_config: Path, tmp_path: Path
) -> None:
    folder = prepare_model_folder(tiny_config, tmp_path / "m", image_size=64)
    config = load_pretrained_config(folder)
    workload = Workload(isl=120, osl=4, images_per_request=2, image_size=64, num_requests=3)
    reqs = make_requests(config, workload)
    per_image = vision_tokens_per_image(config, 64)
    assert per_image == (64 // 16) ** 2 // 4
    for req in reqs:
        ids = req["prompt_token_ids"]
        assert ids.count(config.image_token_id) == 2  # expanded later by the processor
        assert len(ids) + 2 * (per_image - 1) == 120
        assert len(req["multi_modal_data"]["image"]) == 2


def test_isl_too_small_is_rejected(tiny_config: Path, tmp_path: Path) -> None:
    config = load_pretrained_config(prepare_model_folder(tiny_config, tmp_path / "m", 64))
    with pytest.raises(ValueError, match="leaves no room"):
        make_requests(
            config, Workload(isl=5, osl=1, images_per_request=1, image_size=64, num_requests=1)
        )


def test_summary_percentiles() -> None:
    timings = [RequestTiming(0.0, 0.1 * (i + 1), 1.0 + i, 11) for i in range(10)]
    out = summarize(timings, wall=10.0, concurrency=4)
    assert out["output_tok_s"] == pytest.approx(11.0)
    assert out["ttft_ms_p50"] == pytest.approx(550.0)
    assert out["latency_ms_p99"] == pytest.approx(1000.0 * (1.0 + 9 * 0.99 * 1.0), rel=1e-3)
    assert out["per_user_tok_s"] > 0


def test_end_to_end_on_cpu(tiny_config: Path, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    assert (
        main(
            [
                "--config",
                str(tiny_config),
                "--isl",
                "60",
                "--osl",
                "4",
                "--image_size",
                "32",
                "--concurrency",
                "2",
                "--dtype",
                "float32",
                "--device",
                "cpu",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    row = result["ours"][0]
    assert row["concurrency"] == 2 and row["requests"] == 2
    assert row["output_tok_s"] > 0 and row["ttft_ms_p50"] > 0


def test_piecewise_graphs_flag_needs_cuda_graphs(tiny_config: Path) -> None:
    with pytest.raises(SystemExit, match="needs CUDA graphs"):
        main(["--config", str(tiny_config), "--no_cuda_graph", "--piecewise_max_tokens", "256",
              "--device", "cpu"])  # fmt: skip


def test_hf_baseline_on_cpu_leaves_no_temporary_folder(
    tiny_config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "result.json"
    args = ["--config", str(tiny_config), "--isl", "60", "--osl", "4", "--image_size", "32",
            "--concurrency", "1", "--dtype", "float32", "--output", str(out),
            "--hf_baseline", "--hf_max_osl", "3"]  # fmt: skip
    if not torch.cuda.is_available():
        args += ["--device", "auto"]  # "auto" is the CPU here: the baseline crashed on "cuda"
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert result["hf"][0]["output_tok_s"] > 0 and result["ratios"][0]["throughput_ratio"] > 0
    assert list(scratch.iterdir()) == []


def test_guided_json_runs_on_cpu_and_needs_no_ignore_eos(tiny_config: Path, tmp_path: Path) -> None:
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"a": {"enum": ["x", "y"]}},
                                  "required": ["a"], "additionalProperties": False}))  # fmt: skip
    base = ["--config", str(tiny_config), "--isl", "60", "--osl", "24", "--image_size", "32",
            "--concurrency", "2", "--dtype", "float32", "--device", "cpu",
            "--guided_json", str(schema)]  # fmt: skip
    with pytest.raises(SystemExit, match="needs --no-ignore_eos"):
        main(base)
    out = tmp_path / "result.json"
    assert main([*base, "--no-ignore_eos", "--output", str(out)]) == 0
    row = json.loads(out.read_text())["ours"][0]
    # `{"a":"x"}` and the end id: far fewer tokens than the osl.
    assert row["requests"] == 2 and 0 < row["output_tok_s"]
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit, match="a JSON schema object expected"):
        main([*base[:-1], str(bad), "--no-ignore_eos"])


def test_tp_size_2_on_cpu(tiny_config: Path, tmp_path: Path) -> None:
    """`--tp_size 2`: the engine process runs rank 0 and starts rank 1 (gloo on the CPU)."""
    out = tmp_path / "result.json"
    args = ["--config", str(tiny_config), "--isl", "60", "--osl", "4", "--image_size", "32"]
    args += ["--concurrency", "2", "--dtype", "float32", "--device", "cpu", "--tp_size", "2"]
    assert main([*args, "--output", str(out)]) == 0
    row = json.loads(out.read_text())["ours"][0]
    assert row["requests"] == 2 and row["output_tok_s"] > 0
