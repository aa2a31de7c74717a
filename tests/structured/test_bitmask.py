"""The packed token bitmask: packing, unpacking and applying, against plain torch references."""

from __future__ import annotations

import pytest
import torch
import xgrammar

from sonar.structured.bitmask import (
    allocate_bitmask,
    apply_token_bitmask,
    bitmask_words,
    pack_allowed,
    unpack_allowed,
)


def reference_pack(allowed: torch.Tensor) -> torch.Tensor:
    """Bit t % 32 of word t // 32, one token at a time."""
    rows, vocab = allowed.shape
    out = torch.zeros(rows, bitmask_words(vocab), dtype=torch.int64)
    for r in range(rows):
        for t in allowed[r].nonzero().flatten().tolist():
            out[r, t // 32] |= 1 << (t % 32)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 100, 1000])
def test_pack_and_unpack_agree_with_the_bit_layout(vocab: int) -> None:
    generator = torch.Generator().manual_seed(vocab)
    allowed = torch.rand(4, vocab, generator=generator) < 0.5
    allowed[0] = True  # a full row sets the sign bit of its words
    packed = pack_allowed(allowed)
    assert torch.equal(packed, reference_pack(allowed))
    assert torch.equal(unpack_allowed(packed, vocab), allowed)
    assert torch.equal(unpack_allowed(allocate_bitmask(2, vocab), vocab), torch.ones(2, vocab, dtype=torch.bool))


def test_the_layout_is_xgrammars() -> None:
    """xgrammar's own kernel masks the same tokens from the same bitmask."""
    vocab = 300
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, vocab, generator=generator)
    allowed = torch.rand(3, vocab, generator=generator) < 0.3
    packed = pack_allowed(allowed)
    theirs = logits.clone()
    xgrammar.apply_token_bitmask_inplace(theirs, packed, backend="torch_native")
    ours = logits.clone()
    apply_token_bitmask(ours, packed, [0, 1, 2])
    assert torch.equal(ours, theirs)
    assert torch.equal(ours, logits.masked_fill(~allowed, float("-inf")))


def test_apply_masks_only_the_named_rows_in_their_order() -> None:
    vocab = 70
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(5, vocab, generator=generator)
    allowed = torch.rand(2, vocab, generator=generator) < 0.5
    out = logits.clone()
    apply_token_bitmask(out, pack_allowed(allowed), [3, 1])
    expected = logits.clone()
    expected[3] = logits[3].masked_fill(~allowed[0], float("-inf"))
    expected[1] = logits[1].masked_fill(~allowed[1], float("-inf"))
    assert torch.equal(out, expected)
    apply_token_bitmask(out, pack_allowed(allowed)[:0], [])
    assert torch.equal(out, expected)


def test_logits_wider_than_the_bitmask_forbid_the_extra_tokens() -> None:
    logits = torch.zeros(1, 40)
    apply_token_bitmask(logits, allocate_bitmask(1, 32), [0])
    assert torch.isfinite(logits[0, :32]).all() and torch.isinf(logits[0, 32:]).all()


def test_a_step_bitmask_crosses_a_process_boundary_intact() -> None:
    """The scheduler sends a view of the first rows of its buffer; the worker in another process
    decodes a read-only tensor over the frame, which applies as the original does."""
    from sonar.actors.codec import Codec
    from sonar.protocol.engine import StepBitmask, WorkerMsg

    vocab = 1000
    buffer = allocate_bitmask(8, vocab)
    allowed = torch.rand(3, vocab, generator=torch.Generator().manual_seed(2)) < 0.5
    buffer[:3] = pack_allowed(allowed)
    codec = Codec()
    frames = [bytes(f) for f in codec.encode(StepBitmask(7, buffer[:3]))]
    msg = codec.decode(frames, WorkerMsg)
    assert isinstance(msg, StepBitmask) and msg.step_id == 7
    logits = torch.randn(3, vocab)
    applied = logits.clone()
    apply_token_bitmask(applied, msg.bitmask, [0, 1, 2])
    assert torch.equal(applied, logits.masked_fill(~allowed, float("-inf")))
