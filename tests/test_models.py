"""fastdp.train.models: logits shapes, no batch-coupling layers, per-example gradients via vmap(grad), errors."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fastdp.train.models import MODELS, build_model

SHAPES = [(30,), (1, 8, 8), (1, 28, 28)]
CASES = [
    (name, shape, num_classes)
    for name in ("linear", "mlp", "cnn", "auto")
    for shape in SHAPES
    for num_classes in (2, 10)
    if not (name == "cnn" and len(shape) != 3)
]


def ids(case):
    name, shape, num_classes = case
    return f"{name}-{'x'.join(map(str, shape))}-k{num_classes}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_logits_shape(case):
    name, shape, num_classes = case
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    for batch in (1, 5):
        out = model(torch.randn(batch, *shape))
        assert out.shape == (batch, num_classes) and out.dtype == torch.float32
    forbidden = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    assert not any(isinstance(m, forbidden) for m in model.modules()), "no BatchNorm / dropout under DP-SGD"


def test_auto_picks_by_shape():
    assert any(isinstance(m, nn.Conv2d) for m in build_model("auto", (1, 28, 28), 10).modules())
    assert not any(isinstance(m, nn.Conv2d) for m in build_model("auto", (30,), 2).modules())


def test_mlp_hidden_and_depth():
    model = build_model("mlp", (7,), 3, hidden=11, depth=4)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(7, 11), (11, 11), (11, 11), (11, 11), (11, 3)]
    assert len([m for m in model.modules() if isinstance(m, nn.ReLU)]) == 4


def test_linear_is_one_layer():
    model = build_model("linear", (1, 8, 8), 10)
    assert [p.shape for p in model.parameters()] == [(10, 64), (10,)]


@pytest.mark.parametrize("case", [c for c in CASES if c[2] == 10 or c[1] == (30,)], ids=ids)
def test_per_example_grads_vmap(case):
    """vmap(grad) over a batch equals the gradient of each example computed alone (sum-of-losses units)."""
    name, shape, num_classes = case
    torch.manual_seed(0)
    model = build_model(name, shape, num_classes)
    params = {k: v.detach() for k, v in model.named_parameters()}
    x, y = torch.randn(4, *shape), torch.randint(0, num_classes, (4,))

    def loss_one(p, xi, yi):
        logits = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for k, p in model.named_parameters():
            assert per_example[k].shape == (4, *p.shape)
            torch.testing.assert_close(per_example[k][i], p.grad, rtol=1e-4, atol=1e-6, msg=f"{k}, example {i}")


def test_unknown_model():
    names = (
        "auto, backprop_cnn, cnn, linear, lipschitz_mixer, lipschitz_mlp, lipschitz_vgg, mlp, opacus_cnn, "
        "weightclip_cnn, weightclip_mlp"
    )
    with pytest.raises(ValueError, match=f"available: {names}"):
        build_model("resnet", (30,), 2)
    assert set(MODELS) == set(names.split(", "))


def test_opacus_cnn_shape_and_size():
    model = build_model("opacus_cnn", (1, 28, 28), 10)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert sum(p.numel() for p in model.parameters()) == 26010
    with pytest.raises(ValueError, match=r"\(1, 28, 28\)"):
        build_model("opacus_cnn", (1, 8, 8), 10)


def test_backprop_cnn_is_the_repository_model():
    """uvm-plaid/backpropagation-clipping 7f38fe6: no padding, no bias, Linear(288, 32): 4 parameter tensors."""
    model = build_model("backprop_cnn", (1, 28, 28), 10)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(16, 1, 8, 8), (32, 16, 4, 4), (32, 288), (10, 32)]
    with pytest.raises(ValueError, match=r"\(1, 28, 28\)"):
        build_model("backprop_cnn", (1, 8, 8), 10)


@pytest.mark.parametrize("shape", [(30,), (1, 2, 2), (1, 28), (3, 3, 28)])
def test_cnn_unsupported_shape(shape):
    with pytest.raises(ValueError, match=r"cnn supports image input shapes \(C, H, W\)"):
        build_model("cnn", shape, 10)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(input_shape=(), num_classes=2), "input_shape"),
        (dict(input_shape=(0,), num_classes=2), "input_shape"),
        (dict(input_shape=(5,), num_classes=1), "num_classes"),
        (dict(input_shape=(5,), num_classes=2, depth=0), "depth"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model("mlp", **kwargs)
