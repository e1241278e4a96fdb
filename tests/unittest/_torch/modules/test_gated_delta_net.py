"""The Gated DeltaNet layer: HF parity, pool rows by slot, chunked prefill with carried state,
decode steps, mixed batches, and the layer on CUDA. The rule it runs: test_gated_delta_rule.py."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
import torch
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

from tensorrt_llm._torch.modules.gated_delta_net import (
    INPLACE_DECODE_ENV,
    GatedDeltaNet,
    GatedDeltaNetMetadata,
)

HIDDEN = 32
LAYER_SIZES = dict(
    hidden_size=HIDDEN,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=6,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    intermediate_size=16,
    vocab_size=64,
)


# ----------------------------------------------------------------------------- the layer


def _hf_and_ours(
    kind: str = "qwen3_5", seed: int = 0, **sizes: int
) -> tuple[torch.nn.Module, GatedDeltaNet]:
    torch.manual_seed(seed)
    if kind == "qwen3_5":
        config = Qwen3_5TextConfig(**{**LAYER_SIZES, **sizes})
        hf: torch.nn.Module = Qwen3_5GatedDeltaNet(config, 0)
    else:
        config = Qwen3NextConfig(**LAYER_SIZES, num_experts=4, num_experts_per_tok=2)
        hf = Qwen3NextGatedDeltaNet(config, 0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ours = GatedDeltaNet.from_config(config)
    ours.load_weights(hf.state_dict())
    return hf.eval(), ours.eval()


def _states(layer: GatedDeltaNet, n: int, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.full((n, *layer.conv_state_shape), fill),
        torch.full((n, *layer.ssm_state_shape), fill),
    )


def _meta(
    lens: Sequence[int] = (), carry: Sequence[bool] = (), decodes: int = 0
) -> GatedDeltaNetMetadata:
    return GatedDeltaNetMetadata(tuple(lens), tuple(carry), decodes)


@torch.no_grad()
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
@pytest.mark.parametrize("inplace_decode", [False, True])
def test_pool_rows_by_slot_match_per_request_states(
    device: str, inplace_decode: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`ssm_slots` mode (the model's pool, rows addressed by seq slot, read and written in
    place) gives the same outputs and final states as gathered per-request tensors, and
    leaves every other pool row alone; with the in-place decode kernel (the default: Triton
    on CUDA, its torch path on the CPU) and with gather -> step -> scatter (env "0")."""
    monkeypatch.setenv(INPLACE_DECODE_ENV, "1" if inplace_decode else "0")
    _, ours = _hf_and_ours(linear_key_head_dim=16, linear_value_head_dim=16)
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(6, *ours.ssm_state_shape, generator=gen)
    slots = torch.tensor([4, 1, 3])
    steps = [(_meta([5, 3], [False, True], decodes=1), 9), (_meta(decodes=3), 3)]
    conv, _ = _states(ours, 3, fill=0.5)
    conv_ref, ssm_ref = conv.clone(), pool[slots].clone()
    untouched = pool[[0, 2, 5]].clone()
    layer = copy.deepcopy(ours).to(device)
    conv, pool, slots_d = conv.to(device), pool.to(device), slots.to(device)
    tol = dict(atol=1e-2, rtol=1e-2) if device == "cuda" else dict(atol=1e-5, rtol=1e-5)
    for meta, tokens in steps:
        x = torch.randn(tokens, HIDDEN, generator=gen)
        want = ours(x, conv_ref, ssm_ref, meta)
        got = layer(x.to(device), conv, pool, meta, ssm_slots=slots_d)
        torch.testing.assert_close(got.cpu(), want, **tol)
        torch.testing.assert_close(pool.cpu()[slots], ssm_ref, **tol)
        torch.testing.assert_close(conv.cpu(), conv_ref, **tol)
    assert torch.equal(pool.cpu()[[0, 2, 5]], untouched)
    with pytest.raises(ValueError, match="ssm_slots must be"):
        layer(x.to(device), conv, pool, steps[1][0], ssm_slots=slots_d[:2])


@torch.no_grad()
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_prefill_matches_hf(kind: str) -> None:
    hf, ours = _hf_and_ours(kind)
    x = torch.randn(1, 70, HIDDEN)  # more than one 64-token chunk
    conv, ssm = _states(ours, 1, fill=3.0)  # stale slot contents are ignored
    out = ours(x[0], conv, ssm, _meta([70], [False]))
    torch.testing.assert_close(out, hf(x)[0], atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_chunked_prefill_in_three_chunks_equals_one_pass() -> None:
    hf, ours = _hf_and_ours()
    x = torch.randn(150, HIDDEN)
    conv_1, ssm_1 = _states(ours, 1)
    full = ours(x, conv_1, ssm_1, _meta([150], [False]))
    torch.testing.assert_close(full, hf(x[None])[0], atol=1e-5, rtol=1e-4)
    conv, ssm = _states(ours, 1, fill=-2.0)
    outs = []
    for i, (lo, hi) in enumerate([(0, 40), (40, 110), (110, 150)]):
        outs.append(ours(x[lo:hi], conv, ssm, _meta([hi - lo], [i > 0])))
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conv, conv_1)
    torch.testing.assert_close(ssm, ssm_1, atol=1e-5, rtol=1e-4)


@torch.no_grad()
def test_prefill_then_decode_steps_equal_longer_prefill() -> None:
    hf, ours = _hf_and_ours()
    lens, total = (9, 5), 14
    xs = [torch.randn(total, HIDDEN) for _ in lens]
    refs = [hf(x[None])[0] for x in xs]
    conv, ssm = _states(ours, 2, fill=1.0)
    out = ours(
        torch.cat([x[:n] for x, n in zip(xs, lens, strict=True)]),
        conv,
        ssm,
        _meta(lens, [False] * 2),
    )
    torch.testing.assert_close(out[: lens[0]], refs[0][: lens[0]], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(out[lens[0] :], refs[1][: lens[1]], atol=1e-5, rtol=1e-4)
    # Request 0 still has 5 tokens to go, request 1 has 9: decode them side by side.
    steps = [0, 0]
    for _ in range(5):
        pos = [lens[r] + steps[r] for r in range(2)]
        step = ours(torch.stack([xs[r][pos[r]] for r in range(2)]), conv, ssm, _meta(decodes=2))
        for r in range(2):
            torch.testing.assert_close(step[r], refs[r][pos[r]], atol=1e-5, rtol=1e-4)
            steps[r] += 1


@torch.no_grad()
def test_mixed_step_context_and_decode_rows() -> None:
    """One step: a fresh context request, a continuing chunk, then two decodes."""
    hf, ours = _hf_and_ours(seed=1)
    xs = [torch.randn(12, HIDDEN) for _ in range(4)]
    refs = [hf(x[None])[0] for x in xs]
    conv, ssm = _states(ours, 4, fill=5.0)
    # Bring requests 1..3 to their starting points one at a time (rows 1..3 of the state).
    done = {1: 4, 2: 7, 3: 11}
    for row, n in done.items():
        c, s = conv[row : row + 1], ssm[row : row + 1]
        ours(xs[row][:n], c, s, _meta([n], [False]))
    step_x = torch.cat([xs[0][:6], xs[1][4:10], xs[2][7:8], xs[3][11:12]])
    out = ours(step_x, conv, ssm, _meta([6, 6], [False, True], decodes=2))
    want = torch.cat([refs[0][:6], refs[1][4:10], refs[2][7:8], refs[3][11:12]])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_layer_bad_inputs_raise() -> None:
    _, ours = _hf_and_ours()
    conv, ssm = _states(ours, 1)
    x = torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="tokens but the metadata"):
        ours(x, conv, ssm, _meta([4], [False]))
    with pytest.raises(ValueError, match="ssm_states must be"):
        ours(x, conv, ssm[:, :2], _meta([5], [False]))
    with pytest.raises(ValueError, match="conv_states must be"):
        ours(x, conv.expand(2, -1, -1), ssm, _meta([5], [False]))
    with pytest.raises(ValueError, match="has_initial_state has"):
        GatedDeltaNetMetadata((5,), (), 0)
    with pytest.raises(ValueError, match="positive"):
        GatedDeltaNetMetadata((0,), (False,), 0)
    with pytest.raises(ValueError, match="in_proj_qkvz"):
        ours.load_weights({"in_proj_qkvz.weight": torch.zeros(3, HIDDEN)})
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights({})


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@torch.no_grad()
def test_layer_on_cuda_matches_cpu_and_decode_graph_replays() -> None:
    _, ours = _hf_and_ours(linear_key_head_dim=32, linear_value_head_dim=32)
    x = torch.randn(41, HIDDEN)
    prefill, decode = _meta([20, 19], [False, False]), _meta(decodes=2)
    conv, ssm = _states(ours, 2)
    want_prefill = ours(x[:39], conv, ssm, prefill)
    want_decode = ours(x[39:], conv, ssm, decode)
    gpu = ours.cuda()
    conv_d, ssm_d = (t.cuda() for t in _states(ours, 2))
    x_d = x.cuda()
    got = gpu(x_d[:39], conv_d, ssm_d, prefill)
    torch.testing.assert_close(got.cpu(), want_prefill, atol=1e-2, rtol=1e-2)
    # Decode must be capturable: warm up on copies, capture (which runs nothing), replay once.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gpu(x_d[39:], conv_d.clone(), ssm_d.clone(), decode)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu(x_d[39:], conv_d, ssm_d, decode)
    graph.replay()
    torch.testing.assert_close(out.cpu(), want_decode, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(ssm_d.cpu(), ssm, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(conv_d.cpu(), conv, atol=1e-5, rtol=1e-5)
