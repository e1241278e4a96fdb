"""The tiny writer's issue-16 options: `rope_scaling` merges into each family's rope layout,
`mtp_num_hidden_layers` adds `mtp.*` weights to the Qwen3.5 families only."""

from __future__ import annotations

import pytest

from tensorrt_llm.tools import tiny_checkpoint as tc

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def test_rope_scaling_keeps_the_mrope_sections_of_vl_families() -> None:
    cfg = tc.build_config_dict("qwen3_5", rope_scaling=YARN)
    rope = cfg["text_config"]["rope_parameters"]
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["mrope_section"] == [3, 3, 2] and rope["mrope_interleaved"] is True
    assert rope["partial_rotary_factor"] == 0.25
    # The override is copied, not aliased.
    rope["factor"] = 8.0
    assert YARN["factor"] == 4.0


def test_rope_scaling_is_legacy_rope_scaling_for_text_families() -> None:
    cfg = tc.build_config_dict("qwen3", rope_scaling=YARN)
    assert cfg["rope_scaling"] == YARN and cfg["rope_theta"] == 1e6
    assert "rope_parameters" not in cfg


def test_mtp_layers_only_for_qwen3_5_families() -> None:
    cfg = tc.build_config_dict("qwen3_5_moe", mtp_num_hidden_layers=1)
    assert cfg["text_config"]["mtp_num_hidden_layers"] == 1
    assert "mtp_num_hidden_layers" not in tc.build_config_dict("qwen3_5")["text_config"]
    with pytest.raises(ValueError, match="mtp_num_hidden_layers is for the families"):
        tc.build_config_dict("qwen3_vl", mtp_num_hidden_layers=1)
