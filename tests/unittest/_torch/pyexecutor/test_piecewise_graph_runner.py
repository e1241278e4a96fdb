"""Piecewise graphs for prefill/mixed steps: the split points, the eligibility rule, the engine
wiring and the replay semantics (padded pieces, attention on the live metadata).

The CUDA graphs themselves need a GPU (`gpu` tests, which compare greedy tokens against eager
vanilla). On the CPU, `_EagerPieces` stands in for the runner: it does what a replay does
(static padded inputs, every attention call run by the runner on padded q/k/v with the step's
real metadata) without graphs, so the assumptions the replay rests on are checked here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.piecewise import attention_handler, run_attention
from tensorrt_llm._torch.pyexecutor.piecewise_graph_runner import (
    PiecewiseCUDAGraphRunner,
    piecewise_token_buckets,
    why_not_piecewise,
)
from tensorrt_llm.llmapi.llm_args import CudaGraphConfig, LlmArgs
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

IMAGE = str(Path(tensorrt_llm.__file__).parent / "assets" / "demo.png")
PROMPTS = ["a short prompt", "a somewhat longer text-only prompt about the weather today"]


class _Backend:
    def forward(self, q, k, v, md):
        return q + 1


def test_run_attention_goes_to_the_handler_only_inside_it() -> None:
    q = torch.zeros(2, 4)
    assert torch.equal(run_attention(_Backend(), q, q, q, None), q + 1)
    seen = []
    with attention_handler(lambda b, q, k, v, md: seen.append(md) or q - 1):
        assert torch.equal(run_attention(_Backend(), q, q, q, "md"), q - 1)
        with pytest.raises(RuntimeError, match="already active"):
            with attention_handler(lambda *a: q):
                pass
    assert seen == ["md"]
    with pytest.raises(ValueError):
        with attention_handler(lambda *a: q):
            raise ValueError("boom")
    assert torch.equal(run_attention(_Backend(), q, q, q, None), q + 1)  # handler cleared


def test_token_buckets() -> None:
    assert piecewise_token_buckets(64) == [16, 32, 64]
    assert piecewise_token_buckets(1000) == [16, 32, 64, 128, 256, 384, 512, 640, 768, 896, 1000]
    buckets = piecewise_token_buckets(8192)
    assert buckets[-1] == 8192 and buckets == sorted(set(buckets))
    # A step pads to its bucket: past 256 tokens at most 1/3 of the bucket is padding.
    assert all(b - a <= b / 3 for a, b in zip(buckets[:-1], buckets[1:], strict=True) if a >= 256)


def test_config_validation(tmp_path: Path) -> None:
    assert CudaGraphConfig().piecewise_max_tokens is None  # the engine's default
    assert CudaGraphConfig(piecewise_max_tokens=0).piecewise_max_tokens == 0  # off
    with pytest.raises(ValueError, match="piecewise_max_tokens"):
        CudaGraphConfig(piecewise_max_tokens=-1)
    with pytest.raises(ValueError, match="exceeds max_num_tokens"):
        LlmArgs(
            model=str(tmp_path), max_num_tokens=128, cuda_graph_config={"piecewise_max_tokens": 256}
        )
    args = LlmArgs(model=str(tmp_path), cuda_graph_config={"piecewise_max_tokens": 128})
    assert args.cuda_graph_config.piecewise_max_tokens == 128


def _model(family: str, root: Path):
    ckpt = str(write_tiny_checkpoint(family, root / family))
    with LLM(model=ckpt, max_batch_size=2, executor_mode="inproc") as llm:  # reads the model
        return llm._executor.model_engine.model


@pytest.mark.parametrize(
    "family, reason",
    [
        ("qwen3_vl", ""),
        ("qwen2_5_vl", ""),
        ("qwen3_vl_moe", "layer 0"),
        ("qwen3_5", "not a Qwen2Model"),
        ("qwen3", "not a Qwen-VL model"),
    ],
)
def test_eligible_models(family: str, reason: str, tmp_path: Path) -> None:
    got = why_not_piecewise(_model(family, tmp_path))
    assert (got == "") if not reason else (reason in got)


def test_a_dense_vl_class_needs_its_registration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model("qwen2_5_vl", tmp_path)
    assert model.as_piecewise() is model
    monkeypatch.setattr(type(model), "supports_piecewise", False)
    assert "supports_piecewise" in why_not_piecewise(model) and model.as_piecewise() is None


class _EagerPieces:
    """A replay without graphs: static inputs padded to a bucket (the stale rows filled with
    NaN: any kernel that mixed rows would poison the real ones), the stack run with every
    attention call answered by the backend on the padded q/k/v and the live metadata, as
    `PiecewiseCUDAGraphRunner.replay` does between pieces. The runner's own `can_run` and `run`
    (the InputBatch side: stack inputs, replay, LM head) are used as they are."""

    can_run = PiecewiseCUDAGraphRunner.can_run
    run = PiecewiseCUDAGraphRunner.run
    run_hidden = PiecewiseCUDAGraphRunner.run_hidden

    def __init__(self, model, bucket: int) -> None:
        self.model = model.as_piecewise()
        self.stack = model.llm.model
        self.size = bucket
        self.runs = 0
        self.attention_calls = 0
        self.deepstack_runs = 0

    def bucket(self, num_tokens: int) -> int | None:
        return self.size if num_tokens <= self.size else None

    def replay(self, md, inputs) -> torch.Tensor:
        n = md.num_tokens
        like = inputs.inputs_embeds
        embeds = torch.full((self.size, like.shape[1]), float("nan"), device=like.device)
        cos_sin = torch.full((self.size, inputs.cos_sin.shape[1]), float("nan"), device=like.device)
        embeds[:n], cos_sin[:n] = inputs.inputs_embeds, inputs.cos_sin
        deepstack = None
        if inputs.deepstack_embeds is not None:
            deepstack = [torch.full_like(embeds, float("nan")) for _ in inputs.deepstack_embeds]
            for padded, level in zip(deepstack, inputs.deepstack_embeds, strict=True):
                padded[:n] = level
            self.deepstack_runs += 1

        def attend(backend, q, k, v, _capture_md):
            assert q.shape[0] == self.size  # the pieces hand over padded q/k/v
            self.attention_calls += 1
            return backend.forward(q, k, v, md)

        with attention_handler(attend):
            hidden = self.stack(
                None, inputs_embeds=embeds, cos_sin=cos_sin, deepstack_embeds=deepstack
            )
        self.runs += 1
        return hidden[:n]


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen2_5_vl"])
def test_padded_pieces_give_the_eager_tokens(family: str, tmp_path: Path) -> None:
    """Prefill and mixed steps through the engine's piecewise path (stand-in runner, bucket
    96) give the tokens of the plain eager path; decode steps keep the plain path. With two
    slots, the third request's prefill joins the second's decode once the first stops. The
    third carries an image: Qwen3-VL's deepstack inputs go through the pieces padded."""
    ckpt = str(write_tiny_checkpoint(family, tmp_path / family))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 6, 6)]
    image = {
        "prompt": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe"}]}
        ],
        "multi_modal_data": {"image": [IMAGE]},
    }
    prompts = [*PROMPTS, image]
    # inproc: the test swaps the engine's piecewise graph runner.
    with LLM(model=ckpt, max_batch_size=2, executor_mode="inproc") as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm._executor.model_engine
        pieces = _EagerPieces(engine.model, bucket=96)
        engine.piecewise_graph_runner = pieces
        mixed = []
        real_replay = pieces.replay

        def replay(md, inputs):
            mixed.append(md.num_contexts > 0 and md.num_generations > 0)
            return real_replay(md, inputs)

        pieces.replay = replay
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager
    assert any(mixed)  # a mixed step went through the pieces
    layers = len(engine.model.llm.model.layers)
    assert pieces.runs >= 2 and pieces.attention_calls == pieces.runs * layers
    assert pieces.deepstack_runs == (1 if family == "qwen3_vl" else 0)


def test_prompt_logprobs_through_the_pieces(tmp_path: Path) -> None:
    """A step with a prompt-logprobs request takes the stack's hidden states from the pieces
    (`run_hidden`): the same entries and tokens as the eager path, a batch companion that asks
    for none unchanged."""
    ckpt = str(write_tiny_checkpoint("qwen2_5_vl", tmp_path / "vl"))
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2),
        SamplingParams(max_tokens=3, temperature=0.0),
    ]
    with LLM(model=ckpt, max_batch_size=2, executor_mode="inproc") as llm:
        eager = llm.generate(PROMPTS, params, use_tqdm=False)
        engine = llm._executor.model_engine
        pieces = _EagerPieces(engine.model, bucket=96)
        engine.piecewise_graph_runner = pieces
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    assert pieces.runs >= 1
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in eager]
    assert got[1].prompt_logprobs is None
    mine, want = got[0].prompt_logprobs, eager[0].prompt_logprobs
    assert mine is not None and want is not None and len(mine) == len(want) > 2
    assert mine[0] is None
    for a, b in zip(mine[1:], want[1:], strict=True):
        assert a is not None and b is not None and list(a) == list(b)
        assert [v.logprob for v in a.values()] == pytest.approx(
            [v.logprob for v in b.values()], abs=1e-5
        )
