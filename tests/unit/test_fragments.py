"""Fragment assignment over block-structured and flat parameter lists."""

import pytest
import torch

from dilonode.algo.fragments import assign_fragments, block_index, flatten, unflatten_into

NAMES = ["tok_emb.weight"] + [f"blocks.{i}.{w}" for i in range(6) for w in ("attn.w", "mlp.w")] \
    + ["norm.weight", "lm_head.weight"]


def test_block_index_parses_common_layouts():
    assert block_index("blocks.3.attn.wq.weight") == 3
    assert block_index("model.layers.12.mlp.up_proj.weight") == 12
    assert block_index("transformer.h.0.attn.c_attn.weight") == 0
    assert block_index("tok_emb.weight") is None


def test_strided_assignment_block_i_to_fragment_i_mod_p():
    frags = assign_fragments(NAMES, 3, "strided")
    assert [f.blocks for f in frags] == [(0, 3), (1, 4), (2, 5)]
    # embeddings ride with block 0 (fragment 0); final norm and head with block 5 (fragment 2)
    assert 0 in frags[0].param_indices
    assert {len(NAMES) - 2, len(NAMES) - 1} <= set(frags[2].param_indices)
    covered = sorted(i for f in frags for i in f.param_indices)
    assert covered == list(range(len(NAMES)))


def test_sequential_assignment_is_contiguous():
    frags = assign_fragments(NAMES, 3, "sequential")
    assert [f.blocks for f in frags] == [(0, 1), (2, 3), (4, 5)]
    frags4 = assign_fragments(NAMES, 4, "sequential")
    assert [len(f.blocks) for f in frags4] in ([1, 2, 1, 2], [2, 1, 2, 1], [1, 1, 2, 2],
                                               [2, 2, 1, 1])


def test_model_without_blocks_uses_one_unit_per_parameter():
    frags = assign_fragments(["a.weight", "a.bias", "b.weight"], 2, "strided")
    assert [f.param_indices for f in frags] == [(0, 2), (1,)]


def test_too_many_fragments_is_a_clear_error():
    with pytest.raises(ValueError, match="num_fragments = 7: the model has 6 blocks"):
        assign_fragments(NAMES, 7)


def test_flatten_roundtrip():
    ts = [torch.randn(2, 3), torch.randn(4)]
    flat = flatten(ts)
    assert flat.shape == (10,) and flat.dtype == torch.float32
    targets = [torch.zeros(2, 3), torch.zeros(4)]
    unflatten_into(flat, targets)
    assert all(torch.equal(a, b) for a, b in zip(ts, targets, strict=True))
    with pytest.raises(ValueError, match="flat has 3 values"):
        unflatten_into(torch.zeros(3), targets)
