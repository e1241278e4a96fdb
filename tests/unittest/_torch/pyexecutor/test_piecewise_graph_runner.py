"""Piecewise graphs for prefill/mixed steps: the split points, the eligibility rule, the engine
wiring and the replay semantics (padded pieces, the mixers on the live metadata).

The CUDA graphs themselves need a GPU (`gpu` tests, which compare greedy tokens against eager
vanilla). On the CPU, `_EagerPieces` stands in for the runner: it does what a replay does
(static padded inputs, every mixer call (attention, DeltaNet) run by the runner on the padded
inputs with the step's real metadata) without graphs, so the assumptions the replay rests on
are checked here, for dense, MoE and hybrid stacks.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from text_checkpoints import TEXT_FAMILIES, write_text_checkpoint

import tensorrt_llm
from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.attention_backend.piecewise import run_attention, run_split, split_handler
from tensorrt_llm._torch.models.qwen3_next_recurrent import DeltaNetMixer, StepRows
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


class _Mixer:
    def forward(self, x, md):
        return x * 2


def test_split_calls_go_to_the_handler_only_inside_it() -> None:
    q = torch.zeros(2, 4)
    assert torch.equal(run_attention(_Backend(), q, q, q, None), q + 1)
    assert torch.equal(run_split(_Mixer(), q + 1, attn_metadata=None), q + 2)
    seen = []

    def handler(op, inputs, md):
        seen.append((type(op).__name__, len(inputs), md))
        return inputs[0] - 1

    with split_handler(handler):
        assert torch.equal(run_attention(_Backend(), q, q, q, "md"), q - 1)
        assert torch.equal(run_split(_Mixer(), q, attn_metadata="md2"), q - 1)
        with pytest.raises(RuntimeError, match="already active"):
            with split_handler(lambda *a: q):
                pass
    assert seen == [("_Backend", 3, "md"), ("_Mixer", 1, "md2")]
    with pytest.raises(ValueError):
        with split_handler(lambda *a: q):
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
        ("qwen3_vl_moe", ""),
        ("qwen3_5", ""),
        ("qwen3_5_moe", ""),
        ("qwen_image_bench", ""),
        # Dense text LLMs split fine but are not registered for it (never measured).
        ("qwen3", "Qwen3ForCausalLM is not registered with supports_piecewise=True"),
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


def test_hybrid_and_moe_stacks_split_at_their_mixers(tmp_path: Path) -> None:
    """Each DeltaNet layer of a hybrid stack has its own split op, handed to that layer only;
    MoE layers stay inside the pieces."""
    from tensorrt_llm._torch.modules.fused_moe import MoE

    model = _model("qwen3_5_moe", tmp_path)
    stack = model.llm.model
    gdn_layers = [layer for layer in stack.layers if layer.layer_type == "linear_attention"]
    assert 0 < len(gdn_layers) < len(stack.layers)  # a hybrid stack
    assert [m.gdn for m in stack.mixers] == [layer.linear_attn for layer in gdn_layers]
    assert all(isinstance(layer.mlp, MoE) for layer in stack.layers)
    assert stack.piecewise_blocker() == ""
    spec = model.piecewise_stack()
    assert spec.stack is stack and spec.num_layers == len(stack.layers)
    x = torch.zeros(3, stack.config.hidden_size)
    other = stack.mixers[1] if len(stack.mixers) > 1 else None
    if other is not None:
        with pytest.raises(ValueError, match="another layer's"):
            gdn_layers[0](x, None, None, None, other)


def test_a_text_llm_runs_piecewise_once_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text-only causal LMs (Qwen3-MoE, Qwen3.5 text) share the mixin: its stack inputs are
    the embeddings and rotary rows; through the stand-in pieces the tokens equal eager."""
    ckpt = str(write_tiny_checkpoint("qwen3", tmp_path / "qwen3"))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 6, 6)]
    prompts = [*PROMPTS, "a third prompt that joins once the first one stops"]
    with LLM(model=ckpt, max_batch_size=2, executor_mode="inproc") as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm._executor.model_engine
        assert engine.model.as_piecewise() is None
        monkeypatch.setattr(type(engine.model), "supports_piecewise", True)
        pieces = _EagerPieces(engine.model, bucket=96)
        engine.piecewise_graph_runner = pieces
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager and pieces.runs >= 2


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
        self.stack = self.model.piecewise_stack().stack
        self.size = bucket
        self.runs = 0
        self.split_ops: list[str] = []  # the op type of every mixer call
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

        def mix(op, inputs, _capture_md):
            assert inputs[0].shape[0] == self.size  # the pieces hand over padded inputs
            self.split_ops.append("DeltaNetMixer" if isinstance(op, DeltaNetMixer) else "attn")
            got = op.forward(*inputs, md)
            # The runner's static output: rows a mixer leaves out (DeltaNet runs the real
            # rows only) keep stale values, NaN here.
            out = torch.full_like(inputs[0], float("nan"))
            out[: got.shape[0]] = got
            return out

        with split_handler(mix):
            hidden = self.stack(
                None, inputs_embeds=embeds, cos_sin=cos_sin, deepstack_embeds=deepstack
            )
        self.runs += 1
        return hidden[:n]


@pytest.mark.parametrize(
    "family", ["qwen3_vl", "qwen2_5_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
)
def test_padded_pieces_give_the_eager_tokens(family: str, tmp_path: Path) -> None:
    """Prefill and mixed steps through the engine's piecewise path (stand-in runner, bucket
    96) give the tokens of the plain eager path; decode steps keep the plain path. With two
    slots, the third request's prefill joins the second's decode once the first stops. The
    third carries an image: Qwen3-VL's deepstack inputs go through the pieces padded. MoE
    layers run inside the pieces on the padded rows; each DeltaNet layer of the hybrid
    stacks is a split point, run on the real rows with its recurrent state."""
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
    stack = engine.model.llm.model
    kinds = [
        "DeltaNetMixer" if getattr(layer, "layer_type", "") == "linear_attention" else "attn"
        for layer in stack.layers
    ]
    assert pieces.runs >= 2 and len(pieces.split_ops) == pieces.runs * len(kinds)
    # One split per layer, in layer order: the DeltaNet mixer or the attention backend.
    assert pieces.split_ops == kinds * pieces.runs
    assert ("DeltaNetMixer" in kinds) == family.startswith("qwen3_5")
    assert pieces.deepstack_runs == (1 if family in ("qwen3_vl", "qwen3_vl_moe") else 0)


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


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_chunked_hybrid_prefill_through_the_pieces(family: str, tmp_path: Path) -> None:
    """Long prompts in 64-token chunks: every chunk after the first starts its DeltaNet
    layers from the state the previous chunk (a piecewise step too) left in the slot."""
    ckpt = str(write_tiny_checkpoint(family, tmp_path / family))
    long = " ".join(["the weather report for the coming week, day by day"] * 12)
    prompts = [long, "hello", long + " and the next"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 4)]
    kwargs = dict(max_batch_size=2, max_num_tokens=64, executor_mode="inproc")
    with LLM(model=ckpt, **kwargs) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm._executor.model_engine
        pieces = _EagerPieces(engine.model, bucket=64)
        chunks = []
        real_replay = pieces.replay

        def replay(md, inputs):
            chunks.append(bool(md.num_cached_tokens_cpu[: md.num_contexts].gt(0).any()))
            return real_replay(md, inputs)

        pieces.replay = replay
        engine.piecewise_graph_runner = pieces
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager
    assert sum(chunks) >= 2  # later chunks of a prompt ran through the pieces


@pytest.mark.parametrize("arch", sorted(TEXT_FAMILIES))
def test_moe_and_hybrid_text_llms_through_the_pieces(arch: str, tmp_path: Path) -> None:
    """The registered MoE and hybrid text LLMs run piecewise by default: through the stand-in
    pieces (prefill, chunked and mixed steps) their greedy tokens equal eager."""
    ckpt = str(write_text_checkpoint(arch, tmp_path))
    long = " ".join(["the weather report for the coming week, day by day"] * 12)
    prompts = [long, "hello", "a third prompt that joins once the first one stops"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 6, 6)]
    # No block reuse: the second round must prefill every chunk again.
    kwargs = dict(max_batch_size=2, max_num_tokens=64, enable_block_reuse=False)
    with LLM(model=ckpt, executor_mode="inproc", **kwargs) as llm:
        eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        engine = llm._executor.model_engine
        assert type(engine.model).__name__ == arch and why_not_piecewise(engine.model) == ""
        pieces = _EagerPieces(engine.model, bucket=64)
        engine.piecewise_graph_runner = pieces
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == eager and pieces.runs >= 6  # the long prompt alone has 6 chunks


@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(TEXT_FAMILIES))
def test_text_llm_piecewise_graphs_match_eager_on_gpu(arch: str, tmp_path: Path) -> None:
    """The real graphs (default limit: min(2048, 64) -> buckets 16, 32, 64) against the eager
    vanilla path, fp32: prefill, chunked and mixed steps give the same greedy tokens."""
    ckpt = str(write_text_checkpoint(arch, tmp_path))
    long = " ".join(["the weather report for the coming week, day by day"] * 12)
    prompts = [long, "hello", "a third prompt that joins once the first one stops"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 8, 8)]

    def run(**kwargs) -> tuple[list[list[int]], int]:
        with LLM(
            model=ckpt, device="cuda", dtype="float32", max_batch_size=2, max_num_tokens=64,
            enable_block_reuse=False, executor_mode="inproc", **kwargs,
        ) as llm:  # fmt: skip
            runner = llm._executor.model_engine.piecewise_graph_runner
            replays = []
            if runner is not None:
                real_run = runner.run
                runner.run = lambda *a: replays.append(1) or real_run(*a)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], len(replays)

    reference, _ = run(
        attn_backend="vanilla", cuda_graph_config=None, disable_overlap_scheduler=True
    )
    got, replays = run(attn_backend="triton")
    assert got == reference and replays >= 6


def _metadata(num_cached: list[int], seq_lens: list[int]) -> AttentionMetadata:
    n = len(seq_lens)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_contexts=n, num_generations=0, num_ctx_tokens=sum(seq_lens),
        num_tokens=sum(seq_lens), seq_lens_cpu=lens,
        num_cached_tokens_cpu=torch.tensor(num_cached, dtype=torch.int32), seq_lens=lens,
        num_cached_tokens=torch.tensor(num_cached, dtype=torch.int32),
        cu_seqlens_q=torch.zeros(n + 1, dtype=torch.int32), block_tables=torch.zeros(n, 1),
        slot_mapping=torch.zeros(sum(seq_lens), dtype=torch.long),
        seq_slots=torch.arange(n), seq_slots_cpu=torch.arange(n), kv_cache_manager=None,
        tokens_per_block=16,
    )  # fmt: skip


def test_step_rows_are_built_once_per_step_and_hold_no_metadata() -> None:
    """The DeltaNet mixers of one step share its view (built once); a new step's metadata
    rebuilds it; the view never keeps a step's metadata (and its KV cache manager) alive."""
    rows = StepRows()
    md = _metadata([0, 5], [3, 4])
    meta, slots = rows.of(md, torch.device("cpu"))
    assert meta.context_lens == (3, 4) and meta.has_initial_state == (False, True)
    assert slots.tolist() == [0, 1]
    assert rows.of(md, torch.device("cpu"))[0] is meta  # the same step: reused
    other = _metadata([2], [6])
    assert rows.of(other, torch.device("cpu"))[0].context_lens == (6,)
    ref = weakref.ref(other)
    del other
    gc.collect()
    assert ref() is None
