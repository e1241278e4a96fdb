"""`speculative_config`: the MTPDecodingConfig / dict forms, every refusal naming its knob,
the checkpoint check at engine-config time, and trtllm-serve's `--speculative_config`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm.commands.serve import llm_kwargs, parse_args
from tensorrt_llm.llmapi import MTPDecodingConfig
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.serve.server_args import parse_speculative_config_arg
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = Path(tmp_path_factory.mktemp("spec_args"))
    with_mtp = write_tiny_checkpoint("qwen3_5", root / "mtp", mtp_num_hidden_layers=1)
    plain = write_tiny_checkpoint("qwen3_5", root / "plain")
    return {"mtp": str(with_mtp), "plain": str(plain)}


def test_dict_becomes_the_config(tmp_path: Path) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    args = LlmArgs(model=str(tmp_path), speculative_config=spec)
    assert args.speculative_config == MTPDecodingConfig(num_nextn_predict_layers=3)
    assert isinstance(args.speculative_config, MTPDecodingConfig)
    assert args.speculative_config.max_draft_len == 3
    same = LlmArgs(model=str(tmp_path), speculative_config=MTPDecodingConfig(3))
    assert same.speculative_config == args.speculative_config


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"decoding_type": "Eagle", "num_nextn_predict_layers": 1}, "must be one of \\['MTP'\\]"),
        # An upstream Eagle config: the method is named, not its first field MTP lacks.
        ({"decoding_type": "Eagle", "max_draft_len": 3}, "decoding_type must be one of"),
        ({"num_nextn_predict_layers": 2}, "needs decoding_type"),
        ({"decoding_type": "MTP", "max_draft_len": 2}, r"unknown speculative_config .*max_draft"),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": 0}, "int in \\[1, 8\\], got 0"),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": True}, "got True"),
        ({"decoding_type": "MTP", "num_nextn_predict_layers": 9}, "got 9"),
        ("MTP", "must be an MTPDecodingConfig, a dict or None"),
    ],
)
def test_bad_values_name_the_field(tmp_path: Path, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlmArgs(model=str(tmp_path), speculative_config=value)


def test_engine_config_carries_it(ckpts: dict[str, str]) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    args = LlmArgs(model=ckpts["mtp"], speculative_config=spec, disable_overlap_scheduler=True)
    assert args.to_engine_config().speculative_config == MTPDecodingConfig(2)
    assert LlmArgs(model=ckpts["mtp"]).to_engine_config().speculative_config is None


def test_checkpoint_without_mtp_head_is_refused(ckpts: dict[str, str]) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    args = LlmArgs(model=ckpts["plain"], speculative_config=spec, disable_overlap_scheduler=True)
    with pytest.raises(ValueError, match="needs a checkpoint with an MTP head"):
        args.to_engine_config()


def test_overlap_scheduler_is_taken(ckpts: dict[str, str]) -> None:
    """The default (overlap) executor runs MTP too (test_mtp_spec_decode_overlap.py)."""
    args = LlmArgs(model=ckpts["mtp"], speculative_config={"decoding_type": "MTP"})
    config = args.to_engine_config()
    assert not config.disable_overlap_scheduler
    assert config.speculative_config == MTPDecodingConfig(1)


def test_step_budget_must_hold_a_verify_row(ckpts: dict[str, str]) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    args = LlmArgs(
        model=ckpts["mtp"], speculative_config=spec, disable_overlap_scheduler=True,
        max_num_tokens=3,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"max_num_tokens=3 cannot hold one verify row of 1 \+ 3"):
        args.to_engine_config()


def test_block_reuse_is_refused_before_the_model_loads(ckpts: dict[str, str]) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
    args = LlmArgs(model=ckpts["mtp"], speculative_config=spec, enable_block_reuse=True)
    with pytest.raises(ValueError, match="speculative_config with KV block reuse"):
        args.to_engine_config()  # no model is built here: the error comes first
    # Hybrid checkpoints leave reuse off unless asked: MTP alone passes.
    assert (
        LlmArgs(model=ckpts["mtp"], speculative_config=spec).to_engine_config().enable_block_reuse
        is False
    )


def test_serve_flag_takes_json_or_a_file(tmp_path: Path) -> None:
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    args = parse_args(["--demo", "--speculative_config", json.dumps(spec)])
    assert llm_kwargs(args)["speculative_config"] == spec
    path = tmp_path / "spec.yaml"
    path.write_text("decoding_type: MTP\nnum_nextn_predict_layers: 2\n", encoding="utf-8")
    args = parse_args(["--demo", "--speculative_config", str(path), "--disable_overlap_scheduler"])
    kwargs = llm_kwargs(args)
    assert kwargs["speculative_config"] == {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    assert kwargs["disable_overlap_scheduler"] is True
    assert "speculative_config" not in llm_kwargs(parse_args(["--demo"]))


@pytest.mark.parametrize(
    ("text", "match"),
    [("{not json", "not valid JSON"), ("/no/such/file", "neither a JSON object"), ("[1]", "")],
)
def test_serve_flag_errors(text: str, match: str, tmp_path: Path) -> None:
    if text == "[1]":  # a YAML file holding a list
        path = tmp_path / "list.yaml"
        path.write_text("- 1\n", encoding="utf-8")
        text, match = str(path), "expected a mapping, got list"
    with pytest.raises(argparse.ArgumentTypeError, match=match):
        parse_speculative_config_arg(text)
