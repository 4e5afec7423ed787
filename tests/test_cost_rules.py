"""Which per-example norm path each DP layer takes (fastdp.nn.layers): the Gram (ghost / token-match) path or the
per-example gradients, by measured cost and within a memory budget; both give the same certified norm."""

from __future__ import annotations

import torch

from fastdp.nn import Embedding
from fastdp.nn.layers import DIRECT_MEMORY_BUDGET, _embedding_direct, _fits, _use_ghost


def test_gpt2s_vocabulary_at_t_1024_takes_the_token_match_path():
    """B 8, T 1024, V 50257, dim 768: the scatter path took 0.6-1.0 s and 1.2-1.4 GB, token matches 0.18-0.29 s."""
    assert not _embedding_direct(8, 1024, 50257, 768, 4)
    assert _embedding_direct(32, 1024, 1000, 128, 4)  # a small vocabulary over long sequences: the scatter
    assert not _embedding_direct(64, 4096, 50257, 768, 4)  # cheaper by the cost rule, but 9.9 GB: over the budget


def test_the_memory_budget_bounds_every_direct_path():
    assert _fits(DIRECT_MEMORY_BUDGET // 4, itemsize=4) and not _fits(DIRECT_MEMORY_BUDGET // 4 + 1, itemsize=4)
    assert not _use_ghost(512, 64, 64)  # long sequences, small layer: per-example gradients by cost ...
    assert not _fits(2**16, 64, 64, itemsize=4)  # ... unless B p d exceeds the budget (then the Gram path)


def test_both_embedding_paths_bound_the_same_norm():
    torch.manual_seed(0)
    layer = Embedding(3, 8)
    idx = torch.randint(0, 3, (4, 32))  # 64 V < T^2: the scatter path
    g = torch.randn(4, 32, 8)
    direct = layer.per_example_sq_norms((idx,), g)
    layer_big = Embedding(3, 8)
    layer_big.num_embeddings = 10_000  # the same rows, priced as a large vocabulary: the token-match path
    layer_big.weight = layer.weight
    matched = layer_big.per_example_sq_norms((idx,), g)
    exact = torch.stack([torch.zeros(3, 8, dtype=torch.float64).index_add_(0, i, gi.double()).pow(2).sum()
                         for i, gi in zip(idx, g, strict=True)])  # fmt: skip
    torch.testing.assert_close(direct.double(), exact, rtol=1e-5, atol=0)
    assert (matched.double() >= exact * (1 - 1e-12)).all() and torch.allclose(matched.double(), exact, rtol=1e-4)


def test_a_linear_over_long_sequences_forms_per_example_gradients_only_within_the_budget(monkeypatch):
    import fastdp.nn.layers as layers

    a, g = torch.randn(3, 256, 8), torch.randn(3, 256, 4)
    cache: dict = {}
    layers._sequence_weight_sq(a, g, cache)
    assert "weight" in cache  # cheaper and within the budget: formed (and kept for the sum)
    monkeypatch.setattr(layers, "DIRECT_MEMORY_BUDGET", 64)
    cache = {}
    layers._sequence_weight_sq(a, g, cache)
    assert "weight" not in cache  # over the budget: the Gram path
