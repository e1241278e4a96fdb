"""Qwen3.5 (dense, MoE), image-bench and Qwen3-VL-MoE through our engine vs HF transformers.

Tiny random checkpoints, fp32 on CPU. Covered: prefill logits and 8 decode steps (image, video,
text only), a prompt prefilled in 3 chunks, a mixed batch against solo runs, a recycled seq slot
(the hybrid stack's recurrent state must not leak), `language_model_only` checkpoints, and the
upstream startup crash: executor creation (capacity probe with text and multimodal dummies) then
text-only generation, on every route, on CPU and CUDA, also for a class that leaves the mRoPE
device paths out.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from vl_parity_helpers import (
    Stack,
    admit,
    hf_logits,
    make_request,
    our_decode,
    our_prefill,
    prompt,
    release,
)

from tensorrt_llm._torch.config_utils import load_pretrained_config, resolve_architecture
from tensorrt_llm._torch.models.modeling_auto import get_model_class
from tensorrt_llm._torch.models.modeling_multimodal_utils import VISION_DEVICE_PATHS
from tensorrt_llm._torch.models.modeling_qwen3_5 import Qwen3_5VLModel
from tensorrt_llm._torch.models.modeling_utils import ModelConfig
from tensorrt_llm._torch.modules.fused_moe import MoE
from tensorrt_llm._torch.pyexecutor import py_executor_creator
from tensorrt_llm._torch.pyexecutor.llm_request import LlmRequest
from tensorrt_llm._torch.pyexecutor.model_engine import PyTorchModelEngine
from tensorrt_llm._torch.pyexecutor.resource_manager import KVCacheManager, SeqSlotManager
from tensorrt_llm._torch.pyexecutor.scheduler import ScheduledRequests
from tensorrt_llm._torch.weight_loading import build_model_on_meta, load_model
from tensorrt_llm.inputs.multimodal import MultimodalParams
from tensorrt_llm.inputs.registry import create_input_processor
from tensorrt_llm.llmapi.llm_args import LlmArgs
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.tools.tiny_checkpoint import build_config_dict, write_tiny_checkpoint

HF_CLASS = {
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
}
OUR_CLASS = {
    "qwen3_5": "Qwen3_5VLModel",
    "qwen3_5_moe": "Qwen3_5MoeVLModel",
    "qwen3_vl_moe": "Qwen3MoeVLModel",
    "qwen_image_bench": "QwenImageBenchModel",
}
HYBRID = ("qwen3_5", "qwen3_5_moe")
KINDS = ("text", "image", "video")
ATOL = 1e-4
DECODE_STEPS = 8
EXEC_TOKENS = 4
PROMPT = "hello there, how are you"


def _build_stack(family: str, ckpt: Path, device: str = "cpu") -> Stack:
    config = load_pretrained_config(ckpt)
    cls = get_model_class(resolve_architecture(config))
    model_config = ModelConfig(config, max_num_seq_slots=8, checkpoint_dir=str(ckpt))
    model = load_model(cls, model_config, device)
    engine = PyTorchModelEngine(
        model,
        torch.device(device),
        max_num_tokens=1024,
        max_batch_size=8,
        max_seq_len=1024,
        tokens_per_block=16,
    )
    text = config.text_config
    kv = KVCacheManager(
        text.num_hidden_layers,
        text.num_key_value_heads,
        text.head_dim,
        16,
        256,
        64,
        dtype=torch.float32,
        device=device,
    )
    engine.set_kv_cache_manager(kv)
    hf = (
        getattr(transformers, HF_CLASS[family])
        .from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager")
        .eval()
    )
    return Stack(family, create_input_processor(ckpt), engine, kv, SeqSlotManager(8), hf)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = Path(tmp_path_factory.mktemp("qwen3_5"))
    return {f: write_tiny_checkpoint(f, root / f) for f in OUR_CLASS}


@pytest.fixture(scope="module", params=tuple(HF_CLASS))
def stack(request: pytest.FixtureRequest, ckpts: dict[str, Path]) -> Stack:
    return _build_stack(request.param, ckpts[request.param])


def _greedy_ours(stack: Stack, kind: str, rid: int = 1, chunk: int | None = None) -> list[int]:
    req = make_request(stack, rid, prompt(kind))
    admit(stack, req)
    try:
        logits = our_prefill(stack, req, chunk)
        tokens = []
        for _ in range(DECODE_STEPS):
            tokens.append(int(logits.argmax()))
            req.add_new_token(tokens[-1])
            logits = our_decode(stack, [req])[0]
        return tokens
    finally:
        release(stack, req)


def test_routes_build_the_expected_classes(stack: Stack) -> None:
    assert type(stack.engine.model).__name__ == OUR_CLASS[stack.family]


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_match_hf(stack: Stack, kind: str) -> None:
    _check_prefill_and_decode(stack, kind)


@pytest.fixture(scope="module")
def fused_stack(tmp_path_factory: pytest.TempPathFactory) -> Stack:
    """Qwen3.5-MoE whose shared expert is as wide as the routed ones (as in Qwen3.6-35B-A3B),
    so every MoE block runs it as routed expert E (modules/fused_moe/shared_fusion.py)."""
    root = Path(tmp_path_factory.mktemp("qwen3_5_fused"))
    text = build_config_dict("qwen3_5_moe")["text_config"]
    same = {"shared_expert_intermediate_size": text["moe_intermediate_size"]}
    ckpt = write_tiny_checkpoint("qwen3_5_moe", root / "ckpt", text_config=same)
    return _build_stack("qwen3_5_moe", ckpt)


@pytest.mark.parametrize("kind", ("text", "image"))
def test_fused_shared_expert_matches_hf(fused_stack: Stack, kind: str) -> None:
    moes = [m for m in fused_stack.engine.model.modules() if isinstance(m, MoE)]
    assert moes and all(m.shared_fused and m.shared_expert is None for m in moes)
    _check_prefill_and_decode(fused_stack, kind)


def _check_prefill_and_decode(stack: Stack, kind: str) -> None:
    req = make_request(stack, 1, prompt(kind))
    ids, data = list(req.prompt_token_ids), req.hf_inputs
    admit(stack, req)
    try:
        req.context_chunk_size = req.prompt_len
        ours = stack.engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        torch.testing.assert_close(ours.float(), hf_logits(stack, ids, data), atol=ATOL, rtol=0)
        logits = ours[-1].float()
        for _ in range(DECODE_STEPS):
            tok = int(logits.argmax())
            ids.append(tok)
            req.add_new_token(tok)
            logits = our_decode(stack, [req])[0]
            torch.testing.assert_close(logits, hf_logits(stack, ids, data)[-1], atol=ATOL, rtol=0)
    finally:
        release(stack, req)


def test_three_prefill_chunks_give_the_same_tokens(stack: Stack) -> None:
    prompt_len = make_request(stack, 0, prompt("image")).prompt_len
    chunk = -(-prompt_len // 3)
    assert 2 * chunk < prompt_len  # really three chunks
    assert _greedy_ours(stack, "image", chunk=chunk) == _greedy_ours(stack, "image")


def test_mixed_batch_matches_solo_runs(stack: Stack) -> None:
    kinds = ["text", "image", "video", "text", "image", "video"]
    solo = {kind: _greedy_ours(stack, kind) for kind in set(kinds)}
    reqs = [make_request(stack, 100 + i, prompt(kind)) for i, kind in enumerate(kinds)]
    for req in reqs:
        admit(stack, req)
    try:
        outs: list[list[int]] = [[] for _ in reqs]
        # Staggered: half the requests prefill while the other half already decode.
        for group in (reqs[:3], reqs[3:]):
            for req in group:
                req.context_chunk_size = req.prompt_len
            gen = [r for r in reqs if r.is_generation]
            logits = stack.engine.forward(ScheduledRequests(group, gen))
            for req, row in zip(group + gen, logits, strict=True):
                outs[reqs.index(req)].append(int(row.argmax()))
                req.add_new_token(outs[reqs.index(req)][-1])
        while any(len(o) < DECODE_STEPS for o in outs):
            live = [r for r, o in zip(reqs, outs, strict=True) if len(o) < DECODE_STEPS]
            for req, row in zip(live, our_decode(stack, live), strict=True):
                outs[reqs.index(req)].append(int(row.argmax()))
                req.add_new_token(outs[reqs.index(req)][-1])
        assert outs == [solo[kind] for kind in kinds]
    finally:
        for req in reqs:
            release(stack, req)


def test_recycled_slot_does_not_leak_state(stack: Stack) -> None:
    first = make_request(stack, 20, prompt("video"))
    admit(stack, first)
    our_prefill(stack, first)
    first.add_new_token(0)
    our_decode(stack, [first])
    slot = first.seq_slot
    release(stack, first)
    req = make_request(stack, 21, prompt("text"))
    ids, data = list(req.prompt_token_ids), req.hf_inputs
    admit(stack, req)
    try:
        assert req.seq_slot == slot
        if stack.family in HYBRID:
            states = stack.engine.model.llm.model.recurrent_states
            assert bool(states.ssm_0[slot].abs().sum() > 0)  # the previous request's state
        logits = our_prefill(stack, req)
        for _ in range(3):
            torch.testing.assert_close(logits, hf_logits(stack, ids, data)[-1], atol=ATOL, rtol=0)
            ids.append(int(logits.argmax()))
            req.add_new_token(ids[-1])
            logits = our_decode(stack, [req])[0]
    finally:
        release(stack, req)


def test_language_model_only_rejects_media(tmp_path: Path) -> None:
    ckpt = write_tiny_checkpoint("qwen3_5", tmp_path, language_model_only=True)
    config = load_pretrained_config(ckpt)
    model = load_model(
        get_model_class(resolve_architecture(config)),
        ModelConfig(config, checkpoint_dir=str(ckpt)),
        "cpu",
    )
    assert model.visual is None
    engine = PyTorchModelEngine(
        model,
        torch.device("cpu"),
        max_num_tokens=512,
        max_batch_size=2,
        max_seq_len=512,
        tokens_per_block=16,
    )
    engine.set_kv_cache_manager(
        KVCacheManager(4, 2, 64, 16, 64, 32, dtype=torch.float32, device="cpu")
    )
    stack = Stack(
        "qwen3_5",
        create_input_processor(ckpt),
        engine,
        engine.kv_cache_manager,
        SeqSlotManager(2),
        torch.nn.Identity(),
    )
    text = make_request(stack, 1, prompt("text"))
    admit(stack, text)
    assert our_prefill(stack, text).shape == (config.text_config.vocab_size,)
    release(stack, text)
    req = make_request(stack, 2, prompt("image"))
    admit(stack, req)
    with pytest.raises(ValueError, match="language_model_only"):
        our_prefill(stack, req)


# ----------------------------------------------------------- registered text-only LLMs


def _text_config(family: str, ckpts: dict[str, Path]) -> object:
    text = load_pretrained_config(ckpts[family]).text_config
    if family != "qwen3_vl_moe":
        return text
    # Plain Qwen3-MoE: the Qwen3-VL-MoE text sizes with 1-D RoPE.
    keys = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "intermediate_size",
    )
    return transformers.Qwen3MoeConfig(
        **{k: getattr(text, k) for k in keys},
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_theta=1e6,
        tie_word_embeddings=False,
    )


@pytest.mark.parametrize(
    ("family", "arch", "hf_name"),
    [
        ("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5ForCausalLM"),
        ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForCausalLM"),
        ("qwen3_vl_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),
    ],
)
def test_text_llm_matches_hf(family: str, arch: str, hf_name: str, ckpts: dict[str, Path]) -> None:
    config = _text_config(family, ckpts)
    torch.manual_seed(0)
    hf = getattr(transformers, hf_name)(config).eval()
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 1:  # HF's constant norms would hide a w vs 1 + w mix-up
                param.uniform_(-0.3, 0.3) if bool((param == 0).all()) else param.normal_(1, 0.2)
    model_config = ModelConfig(config, max_num_seq_slots=4)
    model = build_model_on_meta(get_model_class(arch), model_config, "cpu")
    model.load_weights(hf.state_dict())
    engine = PyTorchModelEngine(
        model,
        torch.device("cpu"),
        max_num_tokens=256,
        max_batch_size=4,
        max_seq_len=256,
        tokens_per_block=16,
    )
    engine.set_kv_cache_manager(
        KVCacheManager(
            config.num_hidden_layers,
            config.num_key_value_heads,
            config.head_dim,
            16,
            64,
            16,
            dtype=torch.float32,
            device="cpu",
        )
    )
    ids = [
        int(t)
        for t in torch.randint(
            0, config.vocab_size, (11,), generator=torch.Generator().manual_seed(1)
        )
    ]
    req = LlmRequest(1, ids)
    req.seq_slot = 0
    assert engine.kv_cache_manager.add_tokens(1, len(ids) + 8)
    req.context_chunk_size = req.prompt_len
    with torch.inference_mode():
        ours = engine.forward(ScheduledRequests([req], []), return_context_logits=True)
        for step in range(4):
            ref = hf(input_ids=torch.tensor([ids])).logits[0]
            got = ours if step == 0 else torch.cat([ref[:-1], ours])
            torch.testing.assert_close(got.float(), ref, atol=ATOL, rtol=0)
            ids.append(int(ours[-1].argmax()))
            req.add_new_token(ids[-1])
            ours = engine.forward(ScheduledRequests([], [req]))


# ----------------------------------------------------------- the upstream startup crash


def _hf_greedy(ckpt: Path, family: str, ids: list[int], steps: int) -> list[int]:
    hf_cls = getattr(transformers, HF_CLASS.get(family, "Qwen3_5ForConditionalGeneration"))
    hf = hf_cls.from_pretrained(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    ids = list(ids)
    with torch.inference_mode():
        for _ in range(steps):
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def _start_and_generate(ckpt: Path, device: str) -> tuple[list[int], list[int]]:
    """create_py_executor (runs the capacity probe), then one text-only request."""
    proc = create_input_processor(str(ckpt))
    args = LlmArgs(model=str(ckpt), device=device)
    executor = py_executor_creator.create_py_executor(args.to_engine_config(), proc)
    try:
        ids, extra = proc({"prompt": PROMPT}, None)
        params = MultimodalParams(extra.get("multimodal_data", {})) if extra else None
        sp = SamplingParams(max_tokens=EXEC_TOKENS, temperature=0.0, ignore_eos=True)
        req = LlmRequest(1, ids, sp, multimodal_params=params)
        executor.enqueue_request(req)
        while True:
            resp = executor.responses.get(timeout=60)
            assert resp.error is None
            if resp.finished:
                break
        return list(ids), list(req.output_token_ids)
    finally:
        executor.shutdown()


@pytest.mark.parametrize("family", tuple(OUR_CLASS))
def test_startup_probe_then_text_only_generation(family: str, ckpts: dict[str, Path]) -> None:
    ids, tokens = _start_and_generate(ckpts[family], "cpu")
    assert tokens == _hf_greedy(ckpts[family], family, ids, EXEC_TOKENS)


def test_llm_api_generates_text_only(ckpts: dict[str, Path]) -> None:
    from tensorrt_llm import LLM

    ckpt = ckpts["qwen3_5"]
    with LLM(str(ckpt), device="cpu") as llm:
        sp = SamplingParams(max_tokens=EXEC_TOKENS, temperature=0.0, ignore_eos=True)
        out = llm.generate(PROMPT, sp)
    assert out.outputs[0].token_ids == _hf_greedy(
        ckpt, "qwen3_5", out.prompt_token_ids, EXEC_TOKENS
    )


@pytest.mark.gpu
@pytest.mark.parametrize("family", tuple(OUR_CLASS))
def test_startup_probe_then_text_only_generation_cuda(family: str, tmp_path: Path) -> None:
    assert torch.cuda.is_available()
    _, tokens = _start_and_generate(write_tiny_checkpoint(family, tmp_path), "cuda")
    assert len(tokens) == EXEC_TOKENS


class _NoMropePathsModel(Qwen3_5VLModel):
    """Deliberately lists no mRoPE paths: the deltas stay on the host."""

    multimodal_data_device_paths = list(VISION_DEVICE_PATHS)


@pytest.fixture
def no_mrope_paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Not registered (the registry check requires the paths); swapped in for this test only.
    monkeypatch.setattr(py_executor_creator, "get_model_class", lambda _: _NoMropePathsModel)
    yield


@pytest.mark.gpu
def test_missing_mrope_device_paths_still_start_on_cuda(
    no_mrope_paths: None, tmp_path: Path
) -> None:
    assert torch.cuda.is_available()
    ids, tokens = _start_and_generate(write_tiny_checkpoint("qwen3_5", tmp_path), "cuda")
    assert len(tokens) == EXEC_TOKENS
