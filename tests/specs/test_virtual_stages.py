"""Uneven first/last pipeline stages with interleaving, by Megatron-core's rules."""

from __future__ import annotations

import pytest

from trainpilot.specs import Plan, SpecError, load_model, stage_layers
from trainpilot.specs.job import chunk_layers, virtual_stage_layers

LLAMA = dict(tp=8, pp=16, dp=128, global_batch_size=2048, seq_len=8192,
             pp_first_stage_layers=7, pp_last_stage_layers=7)


def test_edges_that_divide_split_evenly_like_decoder_first_last_flags():
    # Megatron-core: first/vp layers in every chunk of rank 0, middle/vp in a middle rank's.
    assert chunk_layers([6, 8, 8, 6], 2) == [[3, 3], [4, 4], [4, 4], [3, 3]]
    assert chunk_layers([4, 8, 8, 8], 4) == [[1, 1, 1, 1], [2] * 4, [2] * 4, [2] * 4]


def test_llama3_split_takes_the_missing_layer_off_the_outer_chunks():
    """126 layers on pp=16: the embedding (loss) stands in for a layer of rank 0's first
    (the last rank's last) chunk; with chunks of one layer those hold nothing else."""
    model = load_model("llama3-405b")
    for vp, first_rank, last_rank in (
            (2, [3, 4], [4, 3]), (4, [1, 2, 2, 2], [2, 2, 2, 1]),
            (8, [0] + [1] * 7, [1] * 7 + [0])):
        chunks = virtual_stage_layers(model, Plan(vp=vp, **LLAMA))
        assert chunks[0] == first_rank and chunks[-1] == last_rank
        assert all(c == [8 // vp] * vp for c in chunks[1:-1])
        assert stage_layers(model, Plan(vp=vp, **LLAMA)) == [7] + [8] * 14 + [7]
        assert sum(map(sum, chunks)) == 126


def test_vp_one_is_unchanged():
    model = load_model("llama3-405b")
    assert virtual_stage_layers(model, Plan(**LLAMA)) == [[7]] + [[8]] * 14 + [[7]]
    even = Plan(tp=8, pp=8, vp=3, dp=16, global_batch_size=1536, seq_len=2048)
    assert virtual_stage_layers(load_model("gpt3-175b"), even) == [[4, 4, 4]] * 8


@pytest.mark.parametrize("layers, vp, needle", [
    ([5, 8, 8, 8], 4, "stage 0 holds 5 layers"),  # short by 3, more than one chunk of 2
    ([8, 8, 8, 5], 4, "stage 3 holds 5 layers"),  # the last stage short by 3
    ([8, 6, 6, 8], 4, "middle stages"),           # middle does not divide by vp
    ([3, 5], 2, "stage 0 holds 3 layers"),        # pp=2: no middle stage to be short of
])
def test_splits_megatron_cannot_build_are_refused(layers, vp, needle):
    with pytest.raises(SpecError) as err:
        chunk_layers(layers, vp)
    assert needle in str(err.value)


def test_a_bad_plan_names_the_field():
    model = load_model("llama3-405b")
    with pytest.raises(SpecError) as err:
        stage_layers(model, Plan(vp=8, **dict(LLAMA, pp_first_stage_layers=5,
                                              pp_last_stage_layers=9)))
    assert err.value.field == "plan.vp"
