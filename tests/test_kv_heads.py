"""Changing a model's number of K/V heads (labkit.model.kv_heads): pooling and repeating the
k_proj/v_proj rows, and the model that comes out."""

import dataclasses

import pytest
import torch

from labkit.attention.reference import gqa_group_size
from labkit.model.kv_heads import pool_kv_heads, with_kv_heads
from labkit.model.random_weights import SMOLLM2_135M, random_model

SMALL = dataclasses.replace(SMOLLM2_135M, num_layers=2, vocab_size=256, num_heads=6, num_kv_heads=3,
                            hidden_size=96, head_dim=16, intermediate_size=64)


def test_one_group_per_head_is_the_identity():
    weight = torch.randn(3 * 4, 5)
    assert torch.equal(pool_kv_heads(weight, 3, 3), weight)


def test_pooling_averages_the_heads_each_query_head_used():
    num_heads, num_kv, new, head_dim = 12, 6, 2, 4
    weight = torch.randn(num_kv * head_dim, 5)
    pooled = pool_kv_heads(weight, num_kv, new).view(new, head_dim, 5)
    heads = weight.view(num_kv, head_dim, 5)
    old_group, new_group = gqa_group_size(num_heads, num_kv), gqa_group_size(num_heads, new)
    for q in range(num_heads):  # the heads that share q's new K/V head are the old heads of q's new group
        sharing = {p // old_group for p in range(num_heads) if p // new_group == q // new_group}
        assert torch.allclose(pooled[q // new_group], heads[sorted(sharing)].mean(0))


def test_repeating_heads_gives_each_query_head_its_old_kv_head():
    weight = torch.randn(3 * 4, 5)
    repeated = pool_kv_heads(weight, 3, 9).view(9, 4, 5)
    for q in range(9):
        assert torch.equal(repeated[q], weight.view(3, 4, 5)[q // 3])


def test_biases_pool_like_weights():
    bias = torch.randn(6 * 4)
    assert torch.allclose(pool_kv_heads(bias, 6, 3), bias.view(3, 2, 4).mean(1).reshape(-1))


@pytest.mark.parametrize(("old", "new", "message"), [(3, 2, "one count must divide the other"),
                                                     (3, 0, "must be positive"), (5, 1, "do not split")])
def test_impossible_regroupings_say_why(old, new, message):
    with pytest.raises(ValueError, match=message):
        pool_kv_heads(torch.randn(12, 5), old, new)


def test_back_to_mha_changes_no_logit_and_mqa_changes_them():
    model = random_model(SMALL, seed=3)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    ids = torch.randint(256, (12,), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    mha, mqa = with_kv_heads(model, 6), with_kv_heads(model, 1)
    assert (mha.config.num_kv_heads, mqa.config.num_kv_heads) == (6, 1)
    assert mqa.layers[0].self_attn.k_proj.weight.shape == (16, 96)
    assert torch.allclose(mha(ids), logits, atol=1e-5)
    assert not torch.allclose(mqa(ids), logits, atol=1e-3)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())  # original untouched
    assert torch.equal(with_kv_heads(model, 3)(ids), logits)


def test_a_head_count_that_does_not_divide_the_query_heads_is_refused():
    with pytest.raises(ValueError, match="must be a multiple"):
        with_kv_heads(random_model(SMALL), 4)
