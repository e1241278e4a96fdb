"""MTP verify steps as generation rows (spec_decode/verify_batch.py) through the verify graph
runner (spec_decode/verify_graphs.py), on the CPU.

There are no CUDA graphs on the CPU, so a stand-in keeps the real runner's bucketing, padding,
capture metadata and records, and makes each replay an eager run of the call a capture
records, over the same padded buffers. The reference is the engine's own non-speculative
greedy output; the drafts are the reference's continuation with one wrong token a step, so
every verify step rejects drafts and rolls back (from the records, or with a forward)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm._torch.attention_backend.interface import AttentionMetadata
from tensorrt_llm._torch.input_batch import InputBatch
from tensorrt_llm._torch.modules.gated_delta_net_rows import RECORD_MAX_BYTES
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.spec_decode.draft_graphs import DraftGraphRunner
from tensorrt_llm._torch.pyexecutor.spec_decode.rollback import record_bytes_per_token
from tensorrt_llm._torch.pyexecutor.spec_decode.rollback_graphs import RollbackGraphRunner
from tensorrt_llm._torch.pyexecutor.spec_decode.setup import (
    DRAFT_GRAPHS_ENV,
    ROLLBACK_GRAPHS_ENV,
    VERIFY_GRAPHS_ENV,
    draft_graphs_enabled,
    rollback_graphs_enabled,
    verify_graphs_enabled,
)
from tensorrt_llm._torch.pyexecutor.spec_decode.verify_graphs import (
    GRAPH_RECORD_BUDGET,
    VerifyGraphRunner,
    recorded_buckets,
)
from tensorrt_llm.tools.tiny_checkpoint import write_tiny_checkpoint

K = 3
ENGINE = {
    "executor_mode": "inproc",
    "disable_overlap_scheduler": True,
    "max_num_tokens": 16,
    "tokens_per_block": 4,
    "max_batch_size": 4,
}
MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": K}
# Three requests: the verify steps of all three pad to the bucket of 4.
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 13, 3))]
PARAMS = [SamplingParams(max_tokens=n, temperature=0) for n in (14, 11, 17)]


class EagerVerifyRunner(VerifyGraphRunner):
    """`VerifyGraphRunner` with each replay run eagerly (what its capture would record)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, int]] = []  # (rows, bucket)

    def capture(self, bucket: int) -> None:
        raise AssertionError("nothing is captured on the CPU")

    def _metadata(self, bucket: int) -> AttentionMetadata:
        # The capture's metadata, with host views of the padded buffers: the CPU's reference
        # attention loops over those, where the Triton backend a graph captures reads the
        # device tensors only.
        md = super()._metadata(bucket)
        md.seq_lens_cpu = md.seq_lens.clone()
        md.num_cached_tokens_cpu = md.num_cached_tokens.clone()
        md.seq_slots_cpu = md.seq_slots.clone()
        return md

    @torch.inference_mode()
    def run(self, batch: InputBatch) -> torch.Tensor:
        real = batch.attn_metadata.num_generations
        bucket = self.bucket(real // self.rows_per_request)
        assert bucket is not None
        self._pad(real, bucket * self.rows_per_request)
        out = self._model_call(bucket)
        if self._last_record is not None:
            self.records[bucket] = self._last_record
        self.steps.append((real, bucket))
        return out[:real]


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = Path(tmp_path_factory.mktemp("verify_graphs"))
    return write_tiny_checkpoint(request.param, root / request.param, mtp_num_hidden_layers=1)


def _generate(llm: LLM, params: list[SamplingParams] = PARAMS) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    with LLM(model=str(ckpt), **ENGINE) as llm:
        return _generate(llm)


def _one_wrong(reference: list[list[int]], exact: int | None = None) -> Any:
    """Drafts: the reference's next tokens, the second of them one off (all right for prompt
    `exact`)."""
    by_prompt = {tuple(p): out for p, out in zip(PROMPTS, reference, strict=True)}

    def override(req: LlmRequest, drafts: list[int]) -> list[int]:
        prompt = tuple(int(t) for t in req.prompt_token_array)
        cont = by_prompt[prompt]
        done = req.num_generated_tokens
        out = list(cont[done : done + K]) + [0] * K
        if exact is None or prompt != tuple(PROMPTS[exact]):
            out[1] = (out[1] + 1) % 512
        return out[:K]

    return override


class EagerDraftRunner(DraftGraphRunner):
    """`DraftGraphRunner` with each replay an eager run of its passes over the static inputs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[int] = []
        self.offered: list[tuple[int, bool]] = []  # (tokens a request, taken) of each step

    def takes(self, num_requests: int, tokens_per_request: int) -> bool:
        taken = super().takes(num_requests, tokens_per_request)
        self.offered.append((tokens_per_request, taken))
        return taken

    def capture(self, bucket: int) -> None:
        raise AssertionError("nothing is captured on the CPU")

    def _metadata(self, num_rows: int, p: int, table_rows: torch.Tensor) -> AttentionMetadata:
        md = super()._metadata(num_rows, p, table_rows)  # host views, as EagerVerifyRunner's
        md.seq_lens_cpu = md.seq_lens.clone()
        md.num_cached_tokens_cpu = md.num_cached_tokens.clone()
        return md

    @torch.inference_mode()
    def run(self, bucket: int) -> torch.Tensor:
        self.steps.append(bucket)
        return self._passes(bucket)


class EagerRollbackRunner(RollbackGraphRunner):
    """`RollbackGraphRunner` with each replay an eager run of the captured call over the
    static saved rows and index (its buckets are the verify stand-in's recorded ones)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, int]] = []  # (bucket, requests rolled back)

    def takes(self, bucket: int | None) -> bool:
        return bucket in self.batch_sizes

    def capture(self, bucket: int) -> None:
        raise AssertionError("nothing is captured on the CPU")

    def replay(self, bucket: int, kept: Any) -> None:
        self.steps.append((bucket, len(kept)))
        super().replay(bucket, kept)

    @torch.inference_mode()
    def run(self, bucket: int) -> None:
        self._replay(bucket)


def _run_spec(
    ckpt: Path,
    reference: list[list[int]],
    record_budget: int,
    draft_graphs: bool = False,
    heads: dict[tuple[int, int], list[int]] | None = None,
    params: list[SamplingParams] = PARAMS,
    rollback_graphs: bool = False,
    exact: int | None = None,
) -> dict[str, Any]:
    with LLM(model=str(ckpt), speculative_config=MTP, **ENGINE) as llm:
        engine = llm._executor.model_engine
        decoder = llm._executor.spec_decoder
        per_token = record_bytes_per_token(engine.model.per_slot_state())
        runner = EagerVerifyRunner(engine, [1, 2, 4], K + 1, True, per_token, record_budget)
        engine.verify_graph_runner = runner
        if draft_graphs:
            drafter = decoder.drafter
            decoder.draft_graphs = EagerDraftRunner(
                drafter, [1, 2, 4], K, drafter.mtp.hidden_size, engine.max_blocks_per_seq,
                engine.use_mrope,
            )  # fmt: skip
        if rollback_graphs:
            decoder.rollback_graphs = EagerRollbackRunner(
                decoder.rollback, runner, engine.max_batch_size
            )
        wrong = _one_wrong(reference, exact)

        def override(req: LlmRequest, drafts: list[int]) -> list[int]:
            if heads is not None:  # the head's own drafts, by prompt length and position
                heads[(req.prompt_len, req.num_generated_tokens)] = list(drafts)
            return wrong(req, drafts)

        decoder.draft_override = override
        recorded = []
        real = decoder.rollback.replay_recorded

        def replay_recorded(*args: Any) -> None:
            # Whether the records are a verify bucket's (else an eager mixed step's own).
            records = args[1]
            ours = [recs for recs in runner.records.values() if recs]
            recorded.append(any(records[0] is recs[0] for recs in ours))
            real(*args)

        decoder.rollback.replay_recorded = replay_recorded
        outputs = _generate(llm, params)
        return {
            "outputs": outputs,
            "draft_steps": getattr(decoder.draft_graphs, "steps", []),
            "offered": getattr(decoder.draft_graphs, "offered", []),
            "rollback_steps": getattr(decoder.rollback_graphs, "steps", []),
            "steps": runner.steps,
            "recorded": recorded,
            "replays": decoder.stats.num_replays,
            "runner": runner,
        }


def test_verify_steps_replay_the_graph_runner_with_padding(
    ckpt: Path, reference: list[list[int]]
) -> None:
    run = _run_spec(ckpt, reference, record_budget=2**30)
    assert run["outputs"] == reference
    rows = K + 1
    assert run["steps"], "no verify step reached the verify graph runner"
    assert all(real % rows == 0 for real, _ in run["steps"])
    assert any(real < bucket * rows for real, bucket in run["steps"]), run["steps"]
    # Rejecting verify steps rolled back from their bucket's records, not with a forward.
    assert run["replays"] > 0 and any(run["recorded"])
    assert run["runner"].recorded == {1, 2, 4}


def test_buckets_past_the_record_budget_roll_back_with_a_forward(
    ckpt: Path, reference: list[list[int]]
) -> None:
    run = _run_spec(ckpt, reference, record_budget=0)
    assert run["outputs"] == reference
    assert run["steps"] and run["replays"] > 0
    assert not any(run["recorded"]) and run["runner"].recorded == set()


def test_draft_graph_passes_give_the_eager_drafts(ckpt: Path, reference: list[list[int]]) -> None:
    """The draft graphs' padded passes (all 1 + k positions a request, then one row a pass)
    give the head's drafts of the eager passes over the accepted positions, step by step."""
    eager: dict[tuple[int, int], list[int]] = {}
    graphs: dict[tuple[int, int], list[int]] = {}
    base = _run_spec(ckpt, reference, 2**30, draft_graphs=False, heads=eager)
    run = _run_spec(ckpt, reference, 2**30, draft_graphs=True, heads=graphs)
    assert base["outputs"] == run["outputs"] == reference
    assert run["draft_steps"] and any(b > 1 for b in run["draft_steps"]), run["draft_steps"]
    assert graphs == eager


def test_draft_graphs_leave_steps_of_fewer_drafts_to_the_eager_passes(ckpt: Path) -> None:
    """Requests of one `max_tokens` reach their last verify steps together, each verifying
    fewer than k drafts (the budget left): a step of one row length, not the graphs' 1 + k.
    The eager passes draft after it; the graphs take the full steps."""
    params = [SamplingParams(max_tokens=13, temperature=0)] * len(PROMPTS)
    with LLM(model=str(ckpt), **ENGINE) as llm:
        reference = _generate(llm, params)
    run = _run_spec(ckpt, reference, 2**30, draft_graphs=True, params=params)
    assert run["outputs"] == reference
    assert run["draft_steps"], "no step reached the draft graphs"
    assert any(1 < n < K + 1 and not taken for n, taken in run["offered"]), run["offered"]


def test_recorded_buckets_fit_the_budget_and_the_step_bound() -> None:
    """The smallest buckets whose records fit the budget together, none past the bound a
    step's records have (`RECORD_MAX_BYTES`: the step would not attach them)."""
    mib = 2**20
    sizes = [1, 2, 4, 8, 16, 24, 32, 48, 64]
    # Qwen3.6-27B at k = 3: ~10.3 MB a request; 1 GiB records up to 32 requests.
    assert recorded_buckets(sizes, 10_250_000, GRAPH_RECORD_BUDGET) == {1, 2, 4, 8, 16, 24, 32}
    assert recorded_buckets(sizes, 10 * mib, 512 * mib) == {1, 2, 4, 8, 16}
    # One bucket alone past RECORD_MAX_BYTES stops there whatever the budget.
    assert recorded_buckets(sizes, RECORD_MAX_BYTES // 40, 2**40) == {1, 2, 4, 8, 16, 24, 32}
    assert recorded_buckets(sizes, 0, 2**40) == set()


def test_recorded_only_keeps_graphs_for_the_buckets_with_records(
    ckpt: Path, reference: list[list[int]]
) -> None:
    """`recorded_only`: with records for the buckets 1 and 2 only, a step of three requests
    gets no graph and runs as chunks (recording its rows); the output stays the reference's."""
    with LLM(model=str(ckpt), speculative_config=MTP, **ENGINE) as llm:
        engine = llm._executor.model_engine
        per_token = record_bytes_per_token(engine.model.per_slot_state())
        budget = 3 * (K + 1) * per_token  # buckets 1 and 2
        runner = EagerVerifyRunner(engine, [1, 2, 4], K + 1, True, per_token, budget, True)
        assert runner.batch_sizes == [1, 2] and runner.recorded == {1, 2}
        assert runner.takes(2, K + 1) and not runner.takes(3, K + 1)
        engine.verify_graph_runner = runner
        llm._executor.spec_decoder.draft_override = _one_wrong(reference)
        outputs = _generate(llm)
    assert outputs == reference
    assert runner.steps and all(bucket <= 2 for _, bucket in runner.steps)


def test_rollback_graph_replays_keep_greedy_output(ckpt: Path, reference: list[list[int]]) -> None:
    """Verify-graph steps roll back through the rollback graph's static rows and index: every
    request of the padded bucket a row, the ones that keep their state on the dummy slot."""
    # The first prompt's drafts are all right: it keeps its state while the others roll back.
    run = _run_spec(ckpt, reference, 2**30, rollback_graphs=True, exact=0)
    assert run["outputs"] == reference
    steps = run["rollback_steps"]
    assert steps, "no rollback reached the rollback graphs"
    assert any(bucket == 4 and kept == 2 for bucket, kept in steps), steps


def test_rollback_graph_index_layout(ckpt: Path) -> None:
    """`fill`: request i's kept tokens are rows i * (1 + k) ..; the others one dummy token."""
    with LLM(model=str(ckpt), speculative_config=MTP, **ENGINE) as llm:
        engine = llm._executor.model_engine
        decoder = llm._executor.spec_decoder
        per_token = record_bytes_per_token(engine.model.per_slot_state())
        runner = EagerVerifyRunner(engine, [1, 2, 4], K + 1, True, per_token, 2**30)
        graphs = EagerRollbackRunner(decoder.rollback, runner, engine.max_batch_size)
        graphs.fill(4, [(1, 3, 7), (3, 1, 5)])
        index = graphs._index(4)
        L, dummy = K + 1, runner.dummy_slot
        assert index.keeps.tolist() == [1, 3, 1, 1]
        assert index.slots.tolist() == [dummy, 7, dummy, 5]
        assert index.cu.tolist() == [0, 1, 4, 5, 6]
        assert index.tokens.tolist()[:6] == [0, L, L + 1, L + 2, 2 * L, 3 * L]
        assert index.starts.tolist() == [0, L, 2 * L, 3 * L]
        assert index.saved_rows.tolist() == [0, 1, 2, 3]
        with pytest.raises(ValueError, match="keeping 5"):
            graphs.fill(4, [(0, 5, 7)])


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("draft_graphs", "rollback_graphs"), [(False, False), (True, False), (True, True)]
)
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_verify_graphs_on_cuda_keep_greedy_output(
    family: str,
    draft_graphs: bool,
    rollback_graphs: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real graphs: captured at startup, replayed by the verify steps (with padding and
    the records' rollback; with `draft_graphs`, the draft passes' graphs after them; with
    `rollback_graphs`, the rollback's graphs), greedy output equal to the non-speculative
    decode graphs'."""
    monkeypatch.setenv(VERIFY_GRAPHS_ENV, "1")
    monkeypatch.setenv(DRAFT_GRAPHS_ENV, "1" if draft_graphs else "0")
    monkeypatch.setenv(ROLLBACK_GRAPHS_ENV, "1" if rollback_graphs else "0")
    ckpt = write_tiny_checkpoint(family, tmp_path / family, mtp_num_hidden_layers=1)
    cuda = {**ENGINE, "device": "cuda", "dtype": "float32", "attn_backend": "triton"}
    with LLM(model=str(ckpt), **cuda) as llm:
        expected = _generate(llm)
    with LLM(model=str(ckpt), speculative_config=MTP, **cuda) as llm:
        engine = llm._executor.model_engine
        runner = engine.verify_graph_runner
        assert runner is not None and set(runner.graphs) == set(runner.batch_sizes)
        replays: list[int] = []
        real_run = runner.run

        def run(batch: InputBatch) -> torch.Tensor:
            replays.append(batch.attn_metadata.num_generations)
            return real_run(batch)

        runner.run = run  # type: ignore[method-assign]
        decoder = llm._executor.spec_decoder
        drafts: list[int] = []
        if draft_graphs:
            assert decoder.draft_graphs is not None
            real_drafts = decoder.draft_graphs.run

            def run_drafts(bucket: int) -> torch.Tensor:
                drafts.append(bucket)
                return real_drafts(bucket)

            decoder.draft_graphs.run = run_drafts  # type: ignore[method-assign]
        rollbacks: list[int] = []
        if rollback_graphs:
            assert decoder.rollback_graphs is not None
            real_rollback = decoder.rollback_graphs.run

            def run_rollback(bucket: int) -> None:
                rollbacks.append(bucket)
                real_rollback(bucket)

            decoder.rollback_graphs.run = run_rollback  # type: ignore[method-assign]
        # The first prompt's drafts all right: it keeps its state beside rolled-back rows.
        decoder.draft_override = _one_wrong(expected, exact=0)
        outputs = _generate(llm)
        stats = decoder.stats
    assert outputs == expected
    assert replays and stats.num_replays > 0
    assert bool(drafts) == draft_graphs
    assert bool(rollbacks) == rollback_graphs
    assert any(rows < runner.bucket(rows // (K + 1)) * (K + 1) for rows in replays)


@pytest.mark.parametrize(
    ("env", "read"),
    [
        (VERIFY_GRAPHS_ENV, verify_graphs_enabled),
        (DRAFT_GRAPHS_ENV, draft_graphs_enabled),
        (ROLLBACK_GRAPHS_ENV, rollback_graphs_enabled),
    ],
)
def test_the_switches_read_0_or_1_only(
    env: str, read: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(env, "1")
    assert read()
    monkeypatch.setenv(env, "0")
    assert not read()
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        read()
