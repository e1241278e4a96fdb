"""MTP speculative decoding on tiny Qwen3.5 checkpoints (dense and MoE) with MTP weights.

The reference is the engine's own non-speculative greedy run: the speculative run must give
token-for-token the same outputs, with the MTP head's drafts (random weights: almost all
rejected), with oracle drafts (the reference's own continuation: all accepted, stops and
max_tokens landing inside accepted runs) and with partly accepted drafts (each step a
different number of correct drafts, then wrong ones: the recurrent state is rolled back).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_decode.spec_decoder import SpecDecoder
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe")
K = 3
VOCAB = 512  # the tiny configs' vocab_size
# Small steps force chunked prefill of the longer prompts (tokens_per_block 4: many blocks).
ENGINE = {
    "executor_mode": "inproc",
    "disable_overlap_scheduler": True,
    "max_num_tokens": 16,
    "tokens_per_block": 4,
    "max_batch_size": 4,
}
MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": K}
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 23, 3, 11))]
MAX_TOKENS = (13, 9, 17, 6)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("mtp_spec"))
    return {f: write_tiny_checkpoint(f, root / f, mtp_num_hidden_layers=1) for f in FAMILIES}


def _params(stop: dict[int, list[int]] | None = None) -> list[SamplingParams]:
    stop = stop or {}
    return [
        SamplingParams(max_tokens=n, temperature=0, stop_token_ids=stop.get(i))
        for i, n in enumerate(MAX_TOKENS)
    ]


def _generate(
    ckpt: Path,
    params: list[SamplingParams],
    spec: dict[str, Any] | None = None,
    override: Callable[[LlmRequest, list[int]], list[int]] | None = None,
) -> tuple[list[list[int]], Any]:
    with LLM(model=str(ckpt), speculative_config=spec, **ENGINE) as llm:
        decoder: SpecDecoder | None = llm._executor.spec_decoder
        if spec is not None:
            assert decoder is not None
            decoder.draft_override = override
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        return outs, None if decoder is None else decoder.stats


def _continuation(
    reference: list[list[int]], correct: Callable[[int], int]
) -> Callable[[LlmRequest, list[int]], list[int]]:
    """Drafts from the reference's own continuation: `correct(num_generated)` of them right,
    the rest one off (never equal to the target's token)."""
    by_prompt = {tuple(p): out for p, out in zip(PROMPTS, reference, strict=True)}

    def override(req: LlmRequest, drafts: list[int]) -> list[int]:
        cont = by_prompt[tuple(int(t) for t in req.prompt_token_array)]
        done = req.num_generated_tokens
        good = correct(done)
        out = []
        for j in range(len(drafts)):
            want = cont[done + j] if done + j < len(cont) else 0
            out.append(want if j < good else (want + 1) % VOCAB)
        return out

    return override


@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_drafts_keep_greedy_output(family: str, ckpts: dict[str, Path]) -> None:
    reference, _ = _generate(ckpts[family], _params())
    outs, stats = _generate(ckpts[family], _params(), MTP)
    assert outs == reference
    assert stats.num_verify_rows > 0 and stats.num_draft_tokens > stats.num_verify_rows


@pytest.mark.parametrize("family", FAMILIES)
def test_oracle_drafts_all_accepted_with_stops_inside_runs(
    family: str, ckpts: dict[str, Path]
) -> None:
    reference, _ = _generate(ckpts[family], _params())
    # Stop tokens that first appear mid-output: a run of 1 + K accepted tokens crosses them.
    stop = {0: [reference[0][5]], 2: [reference[2][10]]}
    expected, _ = _generate(ckpts[family], _params(stop))
    assert len(expected[0]) < len(reference[0]) and len(expected[2]) < len(reference[2])
    outs, stats = _generate(
        ckpts[family], _params(stop), MTP, _continuation(reference, lambda _: K)
    )
    assert outs == expected
    # Every verified draft was right, so no row was rolled back.
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    assert stats.num_replays == 0
    assert stats.acceptance_length > 2.0


@pytest.mark.parametrize("family", FAMILIES)
def test_partly_accepted_drafts_roll_back(family: str, ckpts: dict[str, Path]) -> None:
    reference, _ = _generate(ckpts[family], _params())
    partly = _continuation(reference, lambda done: done % (K + 1))
    outs, stats = _generate(ckpts[family], _params(), MTP, partly)
    assert outs == reference
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_replays > 0


def test_without_rollback_the_output_changes(
    ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The control: skipping the recurrent rollback must break the identity above."""
    ckpt = ckpts["qwen3_5"]
    reference, _ = _generate(ckpt, _params())
    monkeypatch.setattr(SpecDecoder, "_roll_back", lambda self, verify, snapshot: None)
    partly = _continuation(reference, lambda done: done % (K + 1))
    outs, _ = _generate(ckpt, _params(), MTP, partly)
    assert outs != reference


def test_sampled_and_logprobs_requests_run_beside_drafting_ones(ckpts: dict[str, Path]) -> None:
    """A seeded top-p request and a logprobs request verify no drafts and sample exactly as
    without speculation; greedy companions still draft."""
    params = _params()
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0.8, top_p=0.9, seed=7)
    params[3] = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0, logprobs=2)
    reference, _ = _generate(ckpts["qwen3_5"], params)
    outs, stats = _generate(ckpts["qwen3_5"], params, MTP)
    assert outs == reference
    assert stats.num_verify_rows > 0


def test_preemption_under_kv_pressure_keeps_greedy_output(ckpts: dict[str, Path]) -> None:
    """A KV cache too small for every request at once: requests are preempted and prefilled
    again (their MTP KV and recurrent state too); the output stays the reference's."""
    ckpt = ckpts["qwen3_5"]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True) for _ in PROMPTS]
    small = {**ENGINE, "kv_cache_config": {"max_tokens": 96}}

    def run(spec: dict[str, Any] | None, oracle: Any = None) -> tuple[list[list[int]], int]:
        with LLM(model=str(ckpt), speculative_config=spec, **small) as llm:
            if spec is not None:
                llm._executor.spec_decoder.draft_override = oracle
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
            return outs, llm._executor.get_stats().num_preemptions

    reference, _ = run(None)
    partly = _continuation(reference, lambda done: done % (K + 1))
    outs, preemptions = run(MTP, partly)
    assert outs == reference
    assert preemptions > 0


def test_temperature_requests_draft_and_are_reproducible(ckpts: dict[str, Path]) -> None:
    """Temperature sampling verifies drafts by rejection sampling (the distribution: see
    test_spec_rejection.py); a seeded request gives the same tokens run after run, and its
    greedy companions keep the reference output."""
    params = _params()
    for i in (1, 2):
        params[i] = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.9, seed=3 + i)
    reference, _ = _generate(ckpts["qwen3_5"], _params())
    # Drafts that are the greedy continuation: often, not always, what a sampled row draws.
    oracle = _continuation(reference, lambda _: K)
    first, stats = _generate(ckpts["qwen3_5"], params, MTP, oracle)
    again, _ = _generate(ckpts["qwen3_5"], params, MTP, oracle)
    assert first == again
    assert [first[0], first[3]] == [reference[0], reference[3]]
    assert [len(first[1]), len(first[2])] == [MAX_TOKENS[1], MAX_TOKENS[2]]
    assert all(0 <= t < VOCAB for out in first for t in out)
    assert stats.num_draft_tokens > stats.num_verify_rows > 0


def test_prompt_and_output_logprobs_match(ckpts: dict[str, Path]) -> None:
    """Prompt logprobs of chunked prompts (computed from the step's hidden states) and output
    logprobs of a request that verifies no drafts equal the non-speculative run's."""
    ckpt = ckpts["qwen3_5"]
    params = _params()
    params[1] = SamplingParams(max_tokens=MAX_TOKENS[1], temperature=0, prompt_logprobs=2)
    params[3] = SamplingParams(max_tokens=MAX_TOKENS[3], temperature=0, logprobs=1)

    def run(spec: dict[str, Any] | None) -> tuple[Any, Any, list[list[int]]]:
        with LLM(model=str(ckpt), speculative_config=spec, **ENGINE) as llm:
            prompts = [{"prompt_token_ids": p} for p in PROMPTS]
            outs = llm.generate(prompts, params)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
            return outs[1].prompt_logprobs, outs[3].outputs[0].logprobs, tokens

    ref_prompt, ref_out, ref_tokens = run(None)
    prompt, out, tokens = run(MTP)
    assert tokens == ref_tokens
    assert len(prompt) == len(PROMPTS[1]) and prompt[0] is None
    for got, want in zip([*prompt[1:], *out], [*ref_prompt[1:], *ref_out], strict=True):
        assert got.keys() == want.keys()
        for tok, entry in got.items():
            assert entry.rank == want[tok].rank
            assert entry.logprob == pytest.approx(want[tok].logprob, abs=1e-4)


def test_snapshot_memory_is_reserved(ckpts: dict[str, Path]) -> None:
    """KV sizing keeps room for a full batch's recurrent-state snapshot (rollback.py)."""
    from tensorrt_llm._torch.pyexecutor.spec_decode.rollback import record_bytes_per_token
    from tensorrt_llm._torch.pyexecutor.spec_decode.setup import snapshot_reserve_bytes

    with LLM(model=str(ckpts["qwen3_5"]), speculative_config=MTP, **ENGINE) as llm:
        engine = llm._executor.model_engine
        config = llm.args.to_engine_config()
        pools = engine.model.llm.model.recurrent_states
        per_row = sum(b[0].numel() * b.element_size() for b in pools.buffers())
        assert per_row > 0
        assert snapshot_reserve_bytes(config, engine.model, 4) == 4 * per_row
        plain = llm.args.__class__(model=str(ckpts["qwen3_5"])).to_engine_config()
        assert snapshot_reserve_bytes(plain, engine.model, 4) == 0
        # With CUDA graphs, the verify graphs' records of the batch sizes 1, 2 and 4 (all
        # within the budget here) on top.
        graphs = dataclasses.replace(config, use_cuda_graph=True, cuda_graph_batch_sizes=None)
        records = 7 * (K + 1) * record_bytes_per_token(engine.model.per_slot_state())
        assert snapshot_reserve_bytes(graphs, engine.model, 4) == 4 * per_row + records
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRTLLM_MTP_VERIFY_GRAPHS", "0")
            assert snapshot_reserve_bytes(graphs, engine.model, 4) == 4 * per_row


@pytest.mark.parametrize("mode", ["recorded", "not in place", "over the bound"])
def test_rollback_replays_the_recurrence_alone(
    mode: str, ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows rejected in a verify step get their state back through the recorded DeltaNet
    rows (gated_delta_net_rows.replay_rows): one target forward a speculative step, no replay
    forward. Without the in-place rows path (TRTLLM_GDN_INPLACE_DECODE=0: nothing recorded)
    or when the record would hold more than RECORD_MAX_BYTES the replay forward runs; the
    outputs are the reference's every way."""
    from tensorrt_llm._torch.modules.gated_delta_net import INPLACE_DECODE_ENV
    from tensorrt_llm._torch.pyexecutor.spec_decode import spec_decoder

    reference, _ = _generate(ckpts["qwen3_5"], _params())
    in_place = mode == "recorded"
    monkeypatch.setenv(INPLACE_DECODE_ENV, "0" if mode == "not in place" else "1")
    if mode == "over the bound":
        monkeypatch.setattr(spec_decoder, "RECORD_MAX_BYTES", 0)
    partly = _continuation(reference, lambda done: done % (K + 1))
    with LLM(model=str(ckpts["qwen3_5"]), speculative_config=MTP, **ENGINE) as llm:
        decoder = llm._executor.spec_decoder
        assert decoder is not None
        decoder.draft_override = partly
        engine = decoder.engine
        # What a record holds a token: per DeltaNet layer its projections and conv output.
        from tensorrt_llm._torch.modules.gated_delta_net import GatedDeltaNet

        layers = [m for m in engine.model.modules() if isinstance(m, GatedDeltaNet)]
        widths = [2 * g.conv_dim + g.value_dim + 2 * g.num_v_heads for g in layers]
        itemsize = layers[0].norm.weight.element_size()
        assert decoder.rollback.record_bytes_per_token == sum(widths) * itemsize > 0
        forwards: list[int] = []
        real = engine.run_hidden

        def counted(batch: Any) -> Any:
            forwards.append(batch.attn_metadata.num_seqs)
            return real(batch)

        monkeypatch.setattr(engine, "run_hidden", counted)
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, _params())]
        steps = llm._executor.get_stats().num_steps
        replays = decoder.stats.num_replays
    assert outs == reference and replays > 0
    if in_place:
        assert len(forwards) == steps
    else:
        assert len(forwards) > steps
