"""trtllm-bench --speculative_config on CPU: the oracle mode accepts every draft, the rejected
mode none, the model mode reports what the head's drafts got; the flag checks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorrt_llm.commands.bench import main
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict

SPEC = json.dumps({"decoding_type": "MTP", "num_nextn_predict_layers": 3})


@pytest.fixture
def mtp_config(tmp_path: Path) -> Path:
    config = build_config_dict("qwen3_5")
    config["text_config"]["mtp_num_hidden_layers"] = 1
    path = tmp_path / "tiny_mtp.json"
    path.write_text(json.dumps(config))
    return path


def _run(config: Path, out: Path, *extra: str) -> dict[str, float]:
    argv = ["--config", str(config), "--isl", "40", "--osl", "10", "--image_size", "32"]
    argv += ["--concurrency", "2", "--dtype", "float32", "--device", "cpu"]
    assert main([*argv, "--speculative_config", SPEC, *extra, "--output", str(out)]) == 0
    return json.loads(out.read_text())["ours"][0]


@pytest.mark.parametrize(("mode", "rate"), [("oracle", 1.0), ("rejected", 0.0)])
def test_bounding_modes(mtp_config: Path, tmp_path: Path, mode: str, rate: float) -> None:
    row = _run(mtp_config, tmp_path / "r.json", "--draft_mode", mode)
    assert row["draft_acceptance_rate"] == rate
    if mode == "oracle":  # 3 drafts a step, fewer only near max_tokens
        assert 3.0 < row["acceptance_length"] <= 4.0
    else:
        assert row["acceptance_length"] == 1.0
    assert row["requests"] == 2 and row["output_tok_s"] > 0


def test_model_mode_reports_acceptance(mtp_config: Path, tmp_path: Path) -> None:
    row = _run(mtp_config, tmp_path / "r.json")
    assert 1.0 <= row["acceptance_length"] <= 4.0
    assert 0.0 <= row["draft_acceptance_rate"] <= 1.0


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--draft_mode", "oracle"], "--draft_mode goes with --speculative_config"),
        (["--speculative_config", SPEC, "--served"], "runs in process only"),
        (["--speculative_config", SPEC, "--executor_mode", "process"], "needs --executor_mode"),
    ],
)
def test_flag_checks(
    mtp_config: Path, extra: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["--config", str(mtp_config), *extra])
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(("mode", "rate"), [("oracle", 1.0), ("rejected", 0.0)])
@pytest.mark.parametrize("extra", [["--multi_turn", "2"], ["--max_tokens_dist", "4", "10"]])
def test_bounding_modes_hold_on_multi_turn_and_varied_lengths(
    mtp_config: Path, tmp_path: Path, mode: str, rate: float, extra: list[str]
) -> None:
    """The bounds force the verify decision, so they need no recorded continuation: a
    multi-turn run (later turns' prompts hold earlier answers) and early stops keep them."""
    row = _run(mtp_config, tmp_path / "r.json", "--draft_mode", mode, *extra)
    assert row["draft_acceptance_rate"] == rate
