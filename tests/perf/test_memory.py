"""Memory formulas against hand-computed cases (Megatron, ZeRO, Korthikanti et al. 2022)."""

from __future__ import annotations

import pytest

from trainpilot.perf.flops import count_params
from trainpilot.perf.layer import LayerSetup, activation_bytes
from trainpilot.perf.memory import bytes_per_param, in_flight, stage_rank_params
from trainpilot.specs import load_model


@pytest.mark.parametrize("zero, shards, expected", [
    (0, 8, 18.0),            # Megatron without a distributed optimizer (fp32 main grads)
    (1, 8, 6 + 12 / 8),      # Megatron's distributed optimizer: 6 + 12/dp
    (1, 1, 18.0),
    (2, 8, 2 + 16 / 8),      # ZeRO-2 with fp32 gradients: 2P + (4 + 12)P/N
    (3, 8, 18 / 8),          # ZeRO-3: (2 + 4 + 12)P/N
    (2, 1, 18.0),            # one shard: every stage is ZeRO-0 (was 16: smaller than ZeRO-0)
    (3, 1, 18.0),
])
def test_bytes_per_param(zero, shards, expected):
    assert sum(bytes_per_param(zero, shards)) == pytest.approx(expected)


def _gpt(layers=24, hidden=1024, heads=16):
    from trainpilot.perf.validation.cases import gpt

    return gpt(layers, hidden, heads)


def _setup(**kw):
    base = dict(tp=1, cp=1, ep=1, micro_batch_size=2, seq_len=2048, sequence_parallel=False,
                flash_attention=False, dropout=True)
    base.update(kw)
    return LayerSetup(**base)


# Korthikanti et al. 2022 per-layer activation bytes (16-bit, 1-byte masks), s=2048, b=2.
S, B, H, A = 2048, 2, 1024, 16


@pytest.mark.parametrize("t, sp, expected", [
    (1, False, {"none": S * B * H * (34 + 5 * A * S / H), "selective": S * B * H * 34,
                "full": 2 * S * B * H}),
    (4, False, {"none": S * B * H * (10 + 24 / 4 + 5 * A * S / (H * 4)),
                "selective": S * B * H * (10 + 24 / 4), "full": 2 * S * B * H}),
    (4, True, {"none": S * B * H * (34 / 4 + 5 * A * S / (H * 4)),
               "selective": S * B * H * 34 / 4, "full": 2 * S * B * H / 4}),
])
def test_korthikanti_per_layer_activations(t, sp, expected):
    none, selective, full, _ = activation_bytes(_gpt(), False,
                                                _setup(tp=t, sequence_parallel=sp))
    assert none == pytest.approx(expected["none"])
    assert selective == pytest.approx(expected["selective"])
    assert full == pytest.approx(expected["full"])


def test_flash_attention_drops_the_score_tensor():
    none, selective, _, _ = activation_bytes(_gpt(), False, _setup(flash_attention=True))
    # Only the fp32 log-sum-exp per query row remains: 4 bytes x b x a x s.
    assert none - selective == pytest.approx(4 * B * A * S)


def test_gqa_and_swiglu_use_their_shapes():
    model = load_model("llama3-8b")  # h 4096, 32 heads, 8 KV heads, head 128, ffn 14336
    _, selective, _, _ = activation_bytes(model, False, _setup(micro_batch_size=1,
                                                               seq_len=8192, dropout=False))
    m, h, d = 8192, 4096, 128
    replicated = 2 * 4 * m * h  # norm inputs, QKV and fc1 inputs
    attention = 2 * m * (32 * d + 8 * d + 8 * d + 32 * d)  # Q, K, V, output-projection input
    mlp = 2 * m * 14336 * 3  # SwiGLU: two activation inputs, one fc2 input
    assert selective == pytest.approx(replicated + attention + mlp)


def test_in_flight_micro_batches():
    assert [in_flight("1f1b", i, 4, 1, 16) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight("1f1b", 0, 4, 1, 2) == 2  # fewer micro-batches than stages
    assert in_flight("gpipe", 3, 4, 1, 16) == 16
    p, v = 8, 3  # Korthikanti: the first stage holds p (1 + (p-1)/(p v)) micro-batches
    assert in_flight("interleaved", 0, p, v, 64) == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_stage_parameters_add_up_to_the_model():
    model = load_model("gpt3-175b")
    counts, pp, per = count_params(model), 8, 12
    total = sum(stage_rank_params(model, range(i * per, (i + 1) * per), tp=1, ep=1,
                                  first=i == 0, last=i == pp - 1, pp=pp).total
                for i in range(pp))
    assert total == pytest.approx(counts.total)


def test_expert_parameters_shard_over_ep():
    model = load_model("mixtral-8x7b")
    one = stage_rank_params(model, range(32), tp=1, ep=1, first=True, last=True, pp=1)
    four = stage_rank_params(model, range(32), tp=1, ep=4, first=True, last=True, pp=1)
    assert four.expert == pytest.approx(one.expert / 4)
    assert four.dense == pytest.approx(one.dense)


def test_in_flight_weighs_uneven_chunks_by_their_layers():
    """Rank 0 of p=4, v=2 runs 2*3 + 4 + 1 = 11 forwards before its first backward: chunks
    0, 1, 0 in runs of 4 (forward j on chunk (j // p) % v), i.e. 7 passes of chunk 0 and 4 of
    chunk 1. With chunks of 1 and 2 layers that is 7 + 8 = 15 of the rank's 3 layers."""
    assert in_flight("interleaved", 0, 4, 2, 16) == pytest.approx(11 / 2)
    assert in_flight("interleaved", 0, 4, 2, 16, (1, 2)) == pytest.approx(15 / 3)
    assert in_flight("interleaved", 0, 4, 2, 16, (2, 2)) == pytest.approx(11 / 2)
    # Llama 3's first rank: an empty first chunk (the embedding) and seven of one layer.
    chunks = (0,) + (1,) * 7
    assert in_flight("interleaved", 0, 16, 8, 16, chunks) == pytest.approx(16 * 7 / 7)


def test_fp8_keeps_the_gemm_inputs_in_one_byte():
    """Under fp8 the saved QKV, fc1, output-projection and fc2 inputs are 1-byte copies."""
    model = _gpt()
    _, bf16, _, _ = activation_bytes(model, False, _setup(tp=2))
    _, fp8, _, _ = activation_bytes(model, False, _setup(tp=2, gemm_input_bytes=1))
    m = S * B
    gemm_inputs = 2 * m * H + (m * H + m * 4 * H) / 2  # QKV + fc1 inputs; proj + fc2 inputs
    assert bf16 - fp8 == pytest.approx(gemm_inputs)


def test_zero3_buffer_holds_the_layer_in_the_reduce_dtype_too():
    from trainpilot.perf import Estimator, layout_of
    from trainpilot.perf.options import CostOptions
    from trainpilot.specs import Plan, load_cluster

    model, cluster = load_model("llama3-8b"), load_cluster("h100-sxm-x8")
    plan = Plan(dp=8, zero=3, global_batch_size=8, seq_len=4096)
    layer = stage_rank_params(model, range(32), tp=1, ep=1, first=True, last=True,
                              pp=1).largest_layer

    def other_bytes(grad_bytes):
        est = Estimator(model, cluster, CostOptions(grad_reduce_bytes=grad_bytes))
        lay = layout_of(model, plan, est.options)
        stages, _, _ = est.group(lay).memory(lay)
        return stages[0].memory["other"]

    # Gathered layer, prefetched layer, 16-bit gradients: 6 bytes; plus the fp32 copy: 4.
    assert other_bytes(4) - other_bytes(2) == pytest.approx(2 * layer)
