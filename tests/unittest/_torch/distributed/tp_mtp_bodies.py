"""Rank bodies of the MTP-under-tensor-parallelism tests: rank 0 runs real executors (the
scheduler, the sampler, the speculative decoder) and the other ranks the worker loop, once
per tensor-parallel engine rank 0 builds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

from tp_engine_bodies import run_to_completion

from tensorrt_llm._torch.pyexecutor.engine_config import EngineConfig
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.py_executor_creator import create_py_executor
from tensorrt_llm._torch.pyexecutor.tp_worker import run_tp_worker
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.sampling_params import SamplingParams

K = 3  # drafts per step (the one MTP layer runs K passes)
VOCAB = 512  # the tiny configs' vocab_size
# Lengths 7, 23, 3, 11 through 16-token steps and two slots: the long prompts prefill in
# chunks beside other requests' verify rows, and finished requests free their slots.
PROMPTS = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((7, 23, 3, 11))]
MAX_TOKENS = (13, 9, 17, 6)
MTP = {"decoding_type": "MTP", "num_nextn_predict_layers": K}

Override = Callable[[LlmRequest, list[int]], list[int]]


def engine_config(checkpoint_dir: str, speculative: bool, overlap: bool) -> EngineConfig:
    args = LlmArgs(
        model=checkpoint_dir,
        device="cpu",
        max_batch_size=2,
        max_num_tokens=16,
        tokens_per_block=4,
        speculative_config=MTP if speculative else None,
        disable_overlap_scheduler=not overlap,
    )
    return args.to_engine_config()


def generate(config: EngineConfig, override: Override | None = None) -> tuple[Any, Any]:
    """(greedy outputs of PROMPTS, the speculative decoder's stats as a dict or None)."""
    proc = create_input_processor(config.checkpoint_dir)
    executor = create_py_executor(config, proc)
    try:
        decoder = executor.spec_decoder
        if decoder is not None:
            decoder.draft_override = override
        requests = []
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS, strict=True)):
            ids, extra = proc({"prompt_token_ids": prompt}, None)  # the text-only mRoPE params
            params = MultimodalParams(extra.get("multimodal_data", {})) if extra else None
            greedy = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            requests.append(LlmRequest(i + 1, ids, greedy, multimodal_params=params))
        run_to_completion(executor, requests)
        stats = None if decoder is None else asdict(decoder.stats)
        return [list(r.output_token_ids) for r in requests], stats
    finally:
        executor.shutdown()


def partly_correct(reference: list[list[int]]) -> Override:
    """Drafts from the reference's continuation, `num_generated % (K + 1)` of them right and
    the rest one off: each step accepts a different number, so rows roll back by different
    lengths (the workers' recurrent state too)."""
    by_prompt = {tuple(p): out for p, out in zip(PROMPTS, reference, strict=True)}

    def override(req: LlmRequest, drafts: list[int]) -> list[int]:
        cont = by_prompt[tuple(int(t) for t in req.prompt_token_array)]
        done = req.num_generated_tokens
        out = []
        for j in range(len(drafts)):
            want = cont[done + j] if done + j < len(cont) else 0
            out.append(want if j < done % (K + 1) else (want + 1) % VOCAB)
        return out

    return override


def _skip_worker_restore() -> None:
    """The control: a worker that replays without restoring its saved recurrent rows."""
    from tensorrt_llm._torch.pyexecutor.spec_decode import tp_spec

    def replay(self: tp_spec.SpecWorker, restore_slots: list[int]) -> None:
        batch = self._next_batch()
        self.engine.model.forward_hidden(batch)

    def replay_rows(
        self: tp_spec.SpecWorker, restore_slots: list[int], kept: list[tuple[int, int]]
    ) -> None:
        # From the rows as the verify step left them (the pools themselves as the "saved"
        # copies), not from the saved ones.
        from tensorrt_llm._torch.modules.gated_delta_net_rows import replay_rows as replay_from

        assert self.records is not None
        current = {pool.data_ptr(): pool for pool in self.rollback.pools}
        replay_from(self.records, kept, restore_slots, current, restore_slots)

    tp_spec.SpecWorker._replay = replay  # type: ignore[method-assign]
    tp_spec.SpecWorker._replay_rows = replay_rows  # type: ignore[method-assign]


def mtp_tp_runs(mapping: Mapping, checkpoint_dir: str, control: bool = False) -> Any:
    """Rank 0: the non-speculative TP=1 reference, the speculative TP=1 run, then two
    speculative TP=N runs: the head's drafts (overlap executor) and partly correct drafts
    (plain executor). The other ranks: the parts their worker loop ran, per engine.
    `control`: the workers skip restoring the recurrent rows (one partly-correct run)."""
    runs = [(False, "partly")] if control else [(True, None), (False, "partly")]
    if mapping.rank != 0:
        if control:
            _skip_worker_restore()
        tp = [engine_config(checkpoint_dir, True, overlap) for overlap, _ in runs]
        return [run_tp_worker(replace(c, mapping=mapping)) for c in tp]
    reference, _ = generate(engine_config(checkpoint_dir, False, False))
    out: dict[str, Any] = {"reference": reference}
    if not control:
        out["tp1"] = generate(engine_config(checkpoint_dir, True, False))
    for overlap, drafts in runs:
        config = replace(engine_config(checkpoint_dir, True, overlap), mapping=mapping)
        override = partly_correct(reference) if drafts == "partly" else None
        out[drafts or "head"] = generate(config, override)
    return out
