"""MTP speculative steps take the engine's piecewise graphs where a step fits them: the
target forward of every speculative step (prefill chunks and verify rows) and the rollback
replays go through `PyTorchModelEngine.run_hidden`, which picks the piecewise runner.

On the CPU there are no CUDA graphs: a stand-in runner (eager underneath) counts the steps
it is given, and the output must still be the non-speculative greedy output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.input_batch import InputBatch
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

ENGINE = {
    "executor_mode": "inproc",
    "disable_overlap_scheduler": True,
    "max_num_tokens": 16,
    "tokens_per_block": 4,
    "max_batch_size": 4,
}
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 23, 3, 11))]
GREEDY = SamplingParams(max_tokens=9, temperature=0)


class CountingPiecewise:
    """A piecewise runner's interface over the eager forward: which steps it was given."""

    def __init__(self, engine: Any, max_tokens: int) -> None:
        self.engine = engine
        self.max_tokens = max_tokens
        self.steps: list[tuple[int, int]] = []  # (rows, tokens)

    def can_run(self, batch: InputBatch) -> bool:
        md = batch.attn_metadata
        return md.num_contexts > 0 and md.num_tokens <= self.max_tokens

    def run_hidden(self, batch: InputBatch) -> Any:
        md = batch.attn_metadata
        self.steps.append((md.num_seqs, md.num_tokens))
        return self.engine.model.forward_hidden(batch)

    def run(self, batch: InputBatch) -> Any:
        return self.engine.model.forward_batch(batch)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp("mtp_piecewise"))
    return write_tiny_checkpoint("qwen3_5", root / "qwen3_5", mtp_num_hidden_layers=1)


def _outputs(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


def test_speculative_steps_run_in_the_piecewise_graphs(ckpt: Path) -> None:
    with LLM(model=str(ckpt), **ENGINE) as llm:
        reference = _outputs(llm)
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 3}
    with LLM(model=str(ckpt), speculative_config=spec, **ENGINE) as llm:
        engine = llm._executor.model_engine
        runner = CountingPiecewise(engine, max_tokens=16)
        engine.piecewise_graph_runner = runner
        outputs = _outputs(llm)
        stats = llm._executor.spec_decoder.stats
    assert outputs == reference
    # Every speculative step's target forward (<= 16 tokens here) and every replay.
    assert runner.steps
    verify_only = [s for s in runner.steps if s[1] == 4 * s[0]]  # rows of 1 + 3 tokens
    assert verify_only, runner.steps
    assert stats.num_replays > 0
