"""Tier 1: the top-k wire format, the piece layout and the error-feedback store."""

from __future__ import annotations

import pytest
import torch

from trainpilot.runtime.comm import ErrorFeedback, TopKCodec
from trainpilot.runtime.comm.hierarchical import PieceLayout
from trainpilot.specs import SpecError


def test_message_size_at_15_percent_is_5x_smaller_indices_included():
    codec = TopKCodec(density=0.15)
    n = 1 << 20
    assert codec.uses_bitmap((n,))
    # 0.15 x 4 bytes of values + n/8 bytes of bitmap = 0.725 bytes per element
    assert codec.message_bytes((n,), 4) == pytest.approx(0.725 * n, rel=1e-4)
    assert 4 * n / codec.message_bytes((n,), 4) > 5


def test_index_list_replaces_the_bitmap_at_low_density():
    codec = TopKCodec(density=0.01)
    assert not codec.uses_bitmap((10_000,))
    assert codec.message_bytes((10_000,), 4) == 100 * 8


@pytest.mark.parametrize("density", [0.01, 0.15, 1.0])
def test_decoded_sum_equals_the_sum_of_the_selections(density):
    codec = TopKCodec(density=density)
    segments = (700, 1, 299)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(1000, generator=gen, dtype=torch.float64) for _ in range(3)]
    messages, expected = [], torch.zeros(1000, dtype=torch.float64)
    for x in xs:
        message, index = codec.encode(x, segments)
        messages.append(message)
        expected[index] += x[index]
        # each segment keeps its own ceil(density * length) largest entries
        start = 0
        for n in segments:
            picked = index[(index >= start) & (index < start + n)]
            assert len(picked) == max(1, -(-int(density * n * 1e6) // 10**6))
            start += n
    got = codec.decode_sum(torch.stack(messages), segments, torch.float64)
    assert torch.equal(got, expected)


def test_selection_keeps_the_largest_magnitudes():
    x = torch.tensor([0.1, -5.0, 0.2, 4.0, -0.3, 0.0, 3.0, 0.05])
    _, index = TopKCodec(density=0.25).encode(x, (8,))
    assert index.tolist() == [1, 3]


def test_density_is_validated():
    with pytest.raises(SpecError, match="topk_density"):
        TopKCodec(density=0.0)


def test_piece_layout_round_trips_and_ignores_bucketing():
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(10, generator=gen), torch.randn(7, generator=gen)
    one = PieceLayout(segments=(10, 7), num_pieces=4)
    permuted = one.permute(torch.cat([a, b]))
    assert torch.equal(one.unpermute(permuted), torch.cat([a, b]))
    # Piece j of each parameter is the same whether a and b share a bucket or not.
    rows = permuted.view(4, one.row)
    only_a = PieceLayout(segments=(10,), num_pieces=4).permute(a).view(4, -1)
    only_b = PieceLayout(segments=(7,), num_pieces=4).permute(b).view(4, -1)
    assert torch.equal(rows, torch.cat([only_a, only_b], dim=1))


def test_error_feedback_state_round_trip():
    ef = ErrorFeedback(density=0.15)
    ef.store(["w", "b"], [3, 2], torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    restored = ErrorFeedback(density=0.15)
    restored.load_state_dict(ef.state_dict())
    assert torch.equal(restored.gather(["b", "w", "new"], [2, 3, 2], torch.float32),
                       torch.tensor([4.0, 5.0, 1.0, 2.0, 3.0, 0.0, 0.0]))
    with pytest.raises(SpecError, match="density 0.15"):
        ErrorFeedback(density=0.05).load_state_dict(ef.state_dict())
