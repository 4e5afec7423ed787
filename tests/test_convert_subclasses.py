"""convert(): subclasses of supported layers, HuggingFace's Conv1D (a Linear with a transposed weight), one error
naming every refused module. Clipped sums and JL projections against torch.func per-example gradients (float64)."""

import copy
import io

import pytest
import torch
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import per_example_cross_entropy as loss_fn
from fastdp.algorithms.dpsgd import (
    ghost_backward,
    per_example_gradients,
)
from fastdp.algorithms.jl import jl_projections
from fastdp.nn import DPLayer, Linear, TransposedLinear, UnsupportedLayerError, convert, validate
from fastdp.privacy.rng import PrivacyKeys
from tests.variants import assert_ghost_is_reference, projection_reference

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


class ScaledLinear(nn.Linear):
    """A user's subclass: an attribute and a method of its own, forward kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tag = "mine"

    def weight_scale(self) -> torch.Tensor:
        return self.weight.detach().abs().max()


class DoublingLinear(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


class DoublingConv1D(Conv1D):
    def forward(self, x):
        return 2 * super().forward(x)


class Net(nn.Module):
    """NonDynamicallyQuantizableLinear, a user subclass and HF Conv1D layers; ``sequence``: token-wise on [B, T, d]
    (Linear's sequence path: ghost norm or per-example gradient), mean-pooled."""

    def __init__(self, sequence=False, wide=False):
        super().__init__()
        hidden, middle = (24, 24) if wide else (8, 7)  # wide: b and c take the ghost norm on sequences
        self.sequence = sequence
        self.a = NonDynamicallyQuantizableLinear(6, hidden)
        self.b = ScaledLinear(hidden, middle)
        self.c = Conv1D(hidden, middle)  # nf (out) = hidden, nx (in) = middle: weight [middle, hidden]
        self.d = Conv1D(3, hidden)

    def forward(self, x):
        h = self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))
        return h.mean(1) if self.sequence else h


def _data(sequence=False, b=9, seed=1):
    gen = torch.Generator().manual_seed(seed)
    shape = (b, 5, 6) if sequence else (b, 6)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64) * 3
    y = torch.randint(0, 3, (b,), generator=gen)
    return Batch(x, y, torch.ones(b, dtype=torch.bool))


@pytest.mark.parametrize(("sequence", "wide"), [(False, False), (True, False), (True, True)])
def test_clipped_sums_of_subclasses_and_conv1d_equal_torch_func(sequence, wide):
    torch.manual_seed(0)
    model = Net(sequence, wide).double()
    assert_ghost_is_reference(model, _data(sequence))
    assert isinstance(model.a, NonDynamicallyQuantizableLinear) and isinstance(model.a, Linear)
    assert isinstance(model.b, ScaledLinear) and model.b.tag == "mine" and model.b.weight_scale() > 0
    assert isinstance(model.c, Conv1D) and isinstance(model.c, TransposedLinear)
    assert type(model.c).__name__ == "Conv1D" and repr(model.c) == f"Conv1D(nf={model.c.nf}, nx={model.c.nx})"


def test_gpt2_untied_end_to_end_equals_torch_func():
    """A tiny random GPT-2 LM (untied head): Conv1D attention/MLP projections, LayerNorm, token and position
    Embeddings (position ids expanded to [B, T]: DP layers need batch-first inputs)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=13, n_positions=8, n_embd=8, n_layer=1, n_head=2, tie_word_embeddings=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        attn_implementation="eager")  # fmt: skip

    class LastToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = GPT2LMHeadModel(config)

        def forward(self, x):
            b, t = x.shape
            return self.lm(input_ids=x, position_ids=torch.arange(t).expand(b, t)).logits[:, -1]

    torch.manual_seed(0)
    model = LastToken().double()
    assert validate(model) == []
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 13, (4, 6), generator=gen), torch.randint(0, 13, (4,), generator=gen)
    assert_ghost_is_reference(model, Batch(x, y, torch.ones(4, dtype=torch.bool)), clip=0.5)
    assert sum(isinstance(m, TransposedLinear) for m in model.modules()) == 4


@pytest.mark.parametrize(("sequence", "chunk"), [(False, 2), (True, 5)])
def test_jl_projections_of_conv1d_and_subclasses_equal_per_example_gradient_dot_tangent(sequence, chunk):
    torch.manual_seed(0)
    model = Net(sequence)
    batch = _data(sequence, b=7)
    batch = Batch(batch.x.float(), batch.y, batch.mask)
    convert(model)
    r, seed, step = 5, 11, 2
    p, err, allowance = jl_projections(ghost_backward(model, loss_fn, batch), PrivacyKeys(seed), step, r, chunk=chunk)
    expected = projection_reference(model, per_example_gradients(model, loss_fn, batch.x, batch.y), seed, step, r)
    torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
    assert torch.all(err < 1e-6) and torch.all(allowance > 0)


def test_state_dict_parameters_and_an_earlier_optimizer_are_unchanged():
    torch.manual_seed(0)
    model = Net().double()
    before = {k: (v.clone(), v.data_ptr()) for k, v in model.state_dict().items()}
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    reference = copy.deepcopy(model)
    convert(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, (value, ptr) in before.items():
        assert torch.equal(after[k], value) and after[k].data_ptr() == ptr, k
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]

    batch = _data()
    DPSGD(0.05, 0.0, 0.1, 90, reproducible_seed=1).gradient(model, batch, step=0)
    DPSGD(0.05, 0.0, 0.1, 90, reproducible_seed=1, mode="reference").gradient(reference, batch, step=0)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.shape == p.shape  # Conv1D's gradient in its own [in, out] layout
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-13)
    old = [p.detach().clone() for p in params]
    optimizer.step()
    for p, o in zip(params, old, strict=True):
        torch.testing.assert_close(p.detach(), o - 0.5 * p.grad)


def test_converted_subclasses_pickle_and_deepcopy_as_themselves():
    torch.manual_seed(0)
    model = convert(Net())
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for clone in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        for name in ("a", "b", "c"):
            assert type(getattr(clone, name)) is type(getattr(model, name))
        assert clone.b.tag == "mine" and isinstance(clone.c, DPLayer)
        x = torch.randn(3, 6)
        torch.testing.assert_close(clone(x), model(x))


def test_a_subclass_overriding_forward_is_refused_by_name():
    model = nn.Sequential(nn.Linear(4, 4), DoublingLinear(4, 4), DoublingConv1D(4, 4))
    with pytest.raises(UnsupportedLayerError) as raised:
        convert(model)
    message = str(raised.value)
    assert "1 (DoublingLinear): a subclass of torch.nn.modules.linear.Linear that overrides forward" in message
    assert "2 (DoublingConv1D): a subclass of transformers.pytorch_utils.Conv1D that overrides forward" in message
    assert isinstance(model[0], Linear) and not isinstance(model[1], DPLayer) and not isinstance(model[2], DPLayer)
    problems = validate(model)
    assert [p.module for p in problems] == ["1", "2"] and "overrides forward" in problems[0].what
    model[1].requires_grad_(False)  # frozen: nothing to clip, its own forward runs
    model[2].requires_grad_(False)
    convert(model)


def test_every_refused_module_in_one_error():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(4, 3), nn.PReLU(), DoublingLinear(3, 3), nn.BatchNorm1d(3), lin,
                          nn.Embedding(5, 3, max_norm=1.0))  # fmt: skip
    model.add_module("tied", nn.Linear(3, 3))
    model.tied.weight = lin.weight  # accepted: its per-example gradient sums both uses (fastdp.nn.forms)
    with pytest.raises(UnsupportedLayerError) as raised:
        convert(model)
    message = str(raised.value)
    assert "tied" not in message
    for part in ("1 (PReLU)", "2 (DoublingLinear)", "3 (BatchNorm1d)", "5 (Embedding)"):
        assert part in message, part


def test_the_output_projection_of_multihead_attention_is_converted_with_it():
    """torch's attention reads out_proj.weight directly and never calls out_proj; the DP attention calls it, so
    convert() makes it a DP Linear (NonDynamicallyQuantizableLinear kept), trainable alone too (tests/test_attention.py
    for the attention itself, and the subclass overriding forward whose out_proj stays refused)."""
    attention = nn.MultiheadAttention(4, 2)
    attention.in_proj_weight.requires_grad_(False)
    attention.in_proj_bias.requires_grad_(False)
    model = nn.Sequential(attention)
    assert validate(model) == []
    convert(model)
    assert isinstance(attention.out_proj, Linear) and isinstance(attention.out_proj, NonDynamicallyQuantizableLinear)
