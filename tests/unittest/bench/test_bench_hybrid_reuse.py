"""trtllm-bench's --multi_turn workload on a tiny hybrid (Qwen3.5) checkpoint with block reuse
on and off, in process on CPU: with reuse on, later turns hit the history (the previous
turn's prompt and answer, images included) through the recurrent-state snapshots; off, none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tensorrt_llm._torch.config_utils import load_pretrained_config
from tensorrt_llm.bench.multi_turn_run import MultiTurnSpec, run_multi_turn_llm
from tensorrt_llm.bench.served import single_token_words
from tensorrt_llm.bench.workload import Workload, prepare_model_folder
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict

ISL, OSL, TURNS, TURN_TOKENS = 60, 6, 3, 8


@pytest.mark.parametrize("reuse", [True, False])
def test_multi_turn_hits_the_history_only_with_reuse(reuse: bool, tmp_path: Path) -> None:
    from tensorrt_llm.llmapi.llm import LLM

    config_path = tmp_path / "tiny.json"
    config_path.write_text(json.dumps(build_config_dict("qwen3_5")))
    folder = prepare_model_folder(config_path, tmp_path / "m", 32)
    config = load_pretrained_config(folder)
    llm = LLM(model=str(folder), load_format="dummy", dtype="float32", device="cpu",
              max_batch_size=4, max_seq_len=512, tokens_per_block=8,
              kv_cache_config={"enable_block_reuse": reuse})  # fmt: skip
    try:
        workload = Workload(ISL, OSL, 1, 32, 2)
        words = single_token_words(folder / "tokenizer.json")
        spec = MultiTurnSpec(TURNS, TURN_TOKENS)
        _run, turns = run_multi_turn_llm(llm, config, workload, words, spec, 2)
        assert [t["requests"] for t in turns] == [2] * TURNS
        assert turns[0]["prefix_hit_rate"] == 0
        for row in turns[1:]:
            if reuse:
                # At least the previous turn's prompt up to its last block boundary (the
                # prefill's snapshot point): (60 - 8) of turn 2's ~100 tokens, more later.
                assert row["prefix_hit_rate"] >= 0.4, row
            else:
                assert row["prefix_hit_rate"] == 0, row
        assert llm.get_stats().num_running == 0
    finally:
        llm.shutdown()
