"""The step cost estimate: the formula on hand-counted shapes."""

from __future__ import annotations

from sonar.core.flops import MFUStats, ModelShape, StepCost, step_cost

PROJECTIONS = {
    "q_proj": (8, 8),
    "k_proj": (8, 4),
    "v_proj": (8, 4),
    "o_proj": (8, 8),
    "gate_proj": (8, 16),
    "up_proj": (8, 16),
    "down_proj": (16, 8),
}
SHAPE = ModelShape.of(PROJECTIONS, num_layers=2, vocab=10, dtype_bytes=2)


def test_the_shape_of_the_projections() -> None:
    assert SHAPE.projection_weights == 64 + 32 + 32 + 64 + 128 + 128 + 128
    assert (SHAPE.q_dim, SHAPE.kv_dim, SHAPE.hidden) == (8, 4, 8)


def test_a_prefill_of_three_tokens() -> None:
    cost = step_cost(SHAPE, [(0, 3, 1)])
    linear = 2 * 576 * 2 * 3 + 2 * 8 * 10 * 1
    attention = 4 * 8 * 2 * (1 + 2 + 3)  # positions 0, 1, 2 attend to 1, 2, 3 keys
    assert cost.flops == linear + attention
    assert cost.read_bytes == 2 * (576 * 2 + 80 + 2 * 4 * 2 * 3)


def test_a_decode_after_a_cached_prefix_and_a_prefill_chunk_together() -> None:
    decode, chunk = (10, 1, 1), (4, 4, 0)  # a chunk that does not reach the end samples nothing
    both = step_cost(SHAPE, [decode, chunk])
    assert both.flops == (
        2 * 576 * 2 * 5 + 2 * 8 * 10 * 1 + 4 * 8 * 2 * (11 + (4 * 4 + 10))  # 5..8 attend 5..8 keys
    )
    alone = step_cost(SHAPE, [decode]), step_cost(SHAPE, [chunk])
    # weights are read once per step, however many requests it has
    assert both.read_bytes == alone[0].read_bytes + alone[1].read_bytes - 2 * (576 * 2 + 80)


def test_drafts_are_sampled_rows() -> None:
    assert step_cost(SHAPE, [(5, 3, 3)]).flops - step_cost(SHAPE, [(5, 3, 1)]).flops == 2 * 2 * 8 * 10


def test_a_step_without_tokens_costs_nothing() -> None:
    assert step_cost(SHAPE, []) == step_cost(SHAPE, [(7, 0, 0)]) == StepCost(0, 0)


def test_replicas_counts_sum_and_the_peak_stays_per_device() -> None:
    total = MFUStats.summed([MFUStats(10, 20, 1.5, 100.0), MFUStats(5, 7, 0.5, 100.0)])
    assert (total.flops, total.read_bytes, total.busy_seconds, total.peak_flops) == (15, 27, 2.0, 100.0)
