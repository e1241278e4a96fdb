"""trtllm-serve as TensorRT-LLM spells it: the `serve` subcommand, --backend, --tp_size,
--extra_llm_api_options, --log_level's severities (parsing only; no server is started here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tensorrt_llm.commands.serve import llm_kwargs, parse_args
from tensorrt_llm.llmapi.llm_args import LlmArgs


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    return capsys.readouterr().err


def test_serve_subcommand_is_the_old_form() -> None:
    flags = ["--max_seq_len", "64", "--device", "cpu"]
    new, old = parse_args(["serve", "ckpt", *flags]), parse_args(["ckpt", *flags])
    assert vars(new) == vars(old)
    assert new.model_dir == "ckpt" and llm_kwargs(new) == {"max_seq_len": 64, "device": "cpu"}
    assert parse_args(["serve", "--demo"]).demo
    assert parse_args(["--demo"]).demo
    # A folder named "serve" given the old way keeps its meaning.
    assert parse_args(["serve"]).model_dir == "serve"
    assert parse_args(["serve", "serve"]).model_dir == "serve"


def test_serve_subcommand_help_prints_once(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse_args(["serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("usage: trtllm-serve") == 1 and "--extra_llm_api_options" in out


def test_backend_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert llm_kwargs(parse_args(["serve", "ckpt", "--backend", "pytorch"])) == {
        "backend": "pytorch"
    }
    assert "backend" not in llm_kwargs(parse_args(["ckpt"]))  # unset: the LLM's default
    err = _error(capsys, ["serve", "ckpt", "--backend", "tensorrt"])
    assert "--backend tensorrt" in err and "this build does not have" in err
    assert "['pytorch']" in err
    assert "no such backend" in _error(capsys, ["ckpt", "--backend", "torch"])


def test_parallel_size_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    args = parse_args(["serve", "ckpt", "--tp_size", "1", "--pp_size", "1"])
    kwargs = llm_kwargs(args)
    assert kwargs == {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    built = LlmArgs.from_kwargs(model=str(tmp_path), **kwargs)
    assert built.tensor_parallel_size == 1 and built.pipeline_parallel_size == 1
    err = _error(capsys, ["serve", "ckpt", "--pp_size", "2"])
    assert "--pp_size 2: pipeline parallelism is not supported yet" in err
    # Tensor parallelism reaches the LLM (the engine process starts the other ranks).
    assert llm_kwargs(parse_args(["ckpt", "--tp_size", "2"]))["tensor_parallel_size"] == 2
    # Below 1 reaches LlmArgs, which says what it accepts.
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        LlmArgs.from_kwargs(model=str(tmp_path), **llm_kwargs(parse_args(["x", "--tp_size", "0"])))


def test_log_level_severities() -> None:
    for given, level in [
        ("info", "info"),
        ("warning", "warning"),
        ("verbose", "debug"),
        ("trace", "debug"),
        ("internal_error", "critical"),
    ]:
        assert parse_args(["serve", "ckpt", "--log_level", given]).log_level == level
    assert parse_args(["ckpt"]).log_level == "info"


def test_extra_llm_api_options_good(tmp_path: Path) -> None:
    path = _yaml(
        tmp_path,
        "kv_cache_config:\n  free_gpu_memory_fraction: 0.8\n  tokens_per_block: 16\n"
        "cuda_graph_config: {batch_sizes: [1, 2, 4]}\nmax_batch_size: 4\n"
        "mm_processor_kwargs: {max_pixels: 50176}\n",
    )
    args = parse_args(["serve", "ckpt", "--extra_llm_api_options", path, "--max_seq_len", "99"])
    kwargs = llm_kwargs(args)
    assert kwargs == {
        "kv_cache_config": {"free_gpu_memory_fraction": 0.8, "tokens_per_block": 16},
        "cuda_graph_config": {"batch_sizes": [1, 2, 4]},
        "max_batch_size": 4,
        "mm_processor_kwargs": {"max_pixels": 50176},
        "max_seq_len": 99,
    }
    built = LlmArgs.from_kwargs(model=str(tmp_path), **kwargs)
    assert built.kv_cache_free_gpu_memory_fraction == 0.8 and built.tokens_per_block == 16
    assert built.cuda_graph_config is not None
    assert list(built.cuda_graph_config.batch_sizes or []) == [1, 2, 4]
    assert built.max_batch_size == 4 and built.max_seq_len == 99
    # An empty file is no arguments.
    assert llm_kwargs(parse_args(["ckpt", "--extra_llm_api_options", _yaml(tmp_path, "")])) == {}


def test_extra_llm_api_options_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    opt = "--extra_llm_api_options"
    err = _error(capsys, ["ckpt", opt, _yaml(tmp_path, "max_batch_size: 4\nmax_beam_width: 2\n")])
    assert "unknown LLM argument(s) ['max_beam_width']" in err
    assert "valid arguments:" in err and "'kv_cache_config'" in err
    err = _error(capsys, ["ckpt", opt, _yaml(tmp_path, "model: /elsewhere\n")])
    assert "['model']" in err and "positional argument" in err
    err = _error(capsys, ["ckpt", opt, _yaml(tmp_path, "max_seq_len: 64\n"), "--max_seq_len", "9"])
    assert "['max_seq_len'] also given on the command line" in err
    err = _error(capsys, ["ckpt", opt, _yaml(tmp_path, "[1, 2]\n")])
    assert "expected a mapping of LLM arguments, got list" in err
    err = _error(capsys, ["ckpt", opt, _yaml(tmp_path, "max_batch_size: [1\n")])
    last = err.strip().splitlines()[-1]  # the error is one line, after the usage
    assert "not valid YAML" in last and "line 2" in last
    err = _error(capsys, ["ckpt", opt, str(tmp_path / "missing.yaml")])
    assert "cannot read it" in err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("dtype: float64\n", "dtype must be one of"),
        ("max_batch_size: 0\n", "max_batch_size"),
        ("kv_cache_config: {free_gpu_memory_fraction: 1.5}\n", "free_gpu_memory_fraction"),
        ("kv_cache_config: {enable_block_reuse: 2}\n", "enable_block_reuse must be"),
        ("kv_cache_config: {pages: 3}\n", "unknown kv_cache_config field"),
        ("cuda_graph_config: {sizes: [1]}\n", "unknown cuda_graph_config field"),
        ("pipeline_parallel_size: 2\n", "pipeline parallelism is not supported yet"),
        ("backend: tensorrt\n", "backend must be one of"),
    ],
)
def test_extra_llm_api_options_bad_value(tmp_path: Path, text: str, message: str) -> None:
    """Values are checked by LlmArgs, as LLM(...) does before loading anything."""
    args = parse_args(["serve", "ckpt", "--extra_llm_api_options", _yaml(tmp_path, text)])
    with pytest.raises(ValueError, match=message):
        LlmArgs.from_kwargs(model=str(tmp_path), **llm_kwargs(args))


def test_every_flag_has_help_listing_its_values() -> None:
    from tensorrt_llm._torch.quantization import QUANTIZATION_MODES
    from tensorrt_llm.commands.serve_flags import build_parser
    from tensorrt_llm.llmapi.llm_args import ATTN_BACKENDS, DTYPES, KV_CACHE_DTYPES

    actions = {a.dest: a for a in build_parser()._actions if a.dest != "help"}
    assert [dest for dest, a in actions.items() if not a.help] == []
    for dest, values in (
        ("dtype", DTYPES),
        ("attn_backend", ATTN_BACKENDS),
        ("quantization", [m for m in QUANTIZATION_MODES if m]),
        ("kv_cache_dtype", KV_CACHE_DTYPES),
    ):
        text = actions[dest].help or ""
        assert [v for v in values if v not in text] == [], dest
