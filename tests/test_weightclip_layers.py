"""fastdp.nn.weightclip: the Lip-DP-SGD layers' bound rules against per-example gradients (torch.func), on random and
adversarial inputs, and the ``weightclip_cnn`` model trained by the ``weightclip`` variant.

The layer contract, per example i with input x_i (||x_i|| <= X) and a gradient u_i at the output (||u_i|| <= G),
L_i = <u_i, f(x_i)>: ||f(x_i)|| <= propagate(X), ||dL_i/dtheta|| <= sensitivities(X, G)[theta] for each parameter,
||dL_i/dx_i|| <= backpropagate(G). Layers run in float64 (relative slack 1e-9); networks in float32 (1e-5), as in
tests/test_lipschitz.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from fastdp.algorithms import Batch, WeightClip
from fastdp.nn.lipschitz import (
    BoundedInput,
    ClipGradient,
    L2NormPool2d,
    LipschitzLinear,
    Residual,
    TauCrossEntropy,
    lipschitz_bounds,
    project_,
)
from fastdp.nn.weightclip import LipschitzGroupNorm, LipschitzSigmoid, LipschitzTanh, ResidualSum, WeightClipConv2d
from fastdp.ops import conv_operator_norm
from fastdp.train.models import build_model
from tests.variants import per_example_grad_norms, steps_without_host_reads

SLACK64 = 1 + 1e-9
SLACK32 = 1 + 1e-5


def _on_sphere(t: torch.Tensor, radius: float) -> torch.Tensor:
    """Each row of ``t`` rescaled to norm ``radius`` (zero rows stay zero)."""
    norms = t.flatten(1).norm(dim=1).clamp(min=1e-300).reshape(-1, *[1] * (t.dim() - 1))
    return t * (radius / norms)


def layer_ratios(layer: nn.Module, x: torch.Tensor, u: torch.Tensor, x_bound: float, g_bound: float) -> dict:
    """Worst measured / bound of every rule of ``layer`` over the examples (module docstring); x and u must already
    satisfy ||x_i|| <= x_bound and ||u_i|| <= g_bound."""
    assert (x.flatten(1).norm(dim=1) <= x_bound * (1 + 1e-12)).all()
    assert (u.flatten(1).norm(dim=1) <= g_bound * (1 + 1e-12)).all()
    params = {n: p.detach() for n, p in layer.named_parameters()}
    by_name = dict(layer.named_parameters())

    def one(ps, xi, ui):
        return (functional_call(layer, ps, (xi.unsqueeze(0),)).squeeze(0) * ui).sum()

    param_grads, input_grads = vmap(grad(one, argnums=(0, 1)), in_dims=(None, 0, 0))(params, x, u)
    out = layer(x).detach()
    ratios = {
        "output": float(out.flatten(1).norm(dim=1).max()) / float(layer.propagate(x_bound)),
        "input": float(input_grads.flatten(1).norm(dim=1).max()) / float(layer.backpropagate(g_bound)),
    }
    bounds = layer.sensitivities(x_bound, g_bound)
    assert set(bounds) == {p for p in layer.parameters() if p.requires_grad}, "a parameter without a bound"
    for name, g in param_grads.items():
        ratios[name] = float(g.flatten(1).norm(dim=1).max()) / float(bounds[by_name[name]])
    assert torch.isfinite(input_grads).all() and all(torch.isfinite(g).all() for g in param_grads.values())
    return ratios


def assert_within(ratios: dict, slack: float, what: str) -> None:
    over = {k: r for k, r in ratios.items() if not r <= slack}
    assert not over, f"{what}: measured / bound over 1: {over}"


# ------------------------------------------------------------------------------------------------- convolution

CONVS = [  # (in, out, kernel, input_hw, stride, padding, dilation, bias)
    (2, 3, 3, (6, 6), 1, 1, 1, True),
    (3, 4, 3, (7, 5), 2, 1, 1, True),
    (1, 2, 2, (6, 6), 2, 0, 1, False),
    (2, 2, 3, (7, 7), 1, 2, 2, True),
    (2, 5, 1, (4, 4), 1, 0, 1, True),
    (1, 1, 3, (5, 5), 1, 1, 1, True),
]


def _conv_inputs(channels: int, hw: tuple[int, int], x_bound: float, gen: torch.Generator) -> torch.Tensor:
    """Random, constant, one-pixel, checkerboard and corner images, all on the X sphere (float64)."""
    h, w = hw
    random = torch.randn(6, channels, h, w, generator=gen, dtype=torch.float64)
    constant = torch.ones(2, channels, h, w, dtype=torch.float64)
    constant[1] *= -1
    pixel = torch.zeros(2, channels, h, w, dtype=torch.float64)
    pixel[0, :, h // 2, w // 2] = 1.0
    pixel[1, 0, 0, 0] = 1.0
    board = ((torch.arange(h)[:, None] + torch.arange(w)[None, :]) % 2 * 2 - 1).double().expand(1, channels, h, w)
    return _on_sphere(torch.cat([random, constant, pixel, board]), x_bound)


def _output_gradients(y: torch.Tensor, g_bound: float, gen: torch.Generator) -> torch.Tensor:
    """Random, constant per channel (the worst case of a conv bias), and aligned with the output, on the G sphere."""
    n = y.shape[0]
    kinds = torch.arange(n) % 3
    random = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    per_channel = torch.randn(*y.shape[:2], *[1] * (y.dim() - 2), generator=gen, dtype=y.dtype).expand_as(y)
    aligned = y + 1e-30 * random  # nonzero even where y = 0
    u = torch.where((kinds == 0).reshape(-1, *[1] * (y.dim() - 1)), random,
                    torch.where((kinds == 1).reshape(-1, *[1] * (y.dim() - 1)), per_channel, aligned))  # fmt: skip
    return _on_sphere(u, g_bound)


@pytest.mark.parametrize("config", CONVS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("weights", ["projected", "huge", "tiny"])
def test_conv_rules_hold(config, weights):
    cin, cout, k, hw, stride, padding, dilation, bias = config
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    layer = WeightClipConv2d(cin, cout, k, hw, stride, padding, dilation, bias=bias, max_norm=1.5).double()
    with torch.no_grad():
        if bias:
            layer.bias.copy_(3.0 * torch.randn(cout, generator=gen, dtype=torch.float64))
        # not projected again: the rules hold for the weights as they are (certified norms of the current weights)
        layer.weight.mul_({"projected": 1.0, "huge": 1e4, "tiny": 1e-6}[weights])
    for x_bound, g_bound in ((1.0, 1.0), (37.0, 0.01), (1e-3, 1e3)):
        x = _conv_inputs(cin, hw, x_bound, gen)
        u = _output_gradients(layer(x).detach(), g_bound, gen)
        ratios = layer_ratios(layer, x, u, x_bound, g_bound)
        assert_within(ratios, SLACK64, f"{config} {weights} X={x_bound} G={g_bound}")
        if bias:  # a constant-per-channel output gradient meets sqrt(P) G exactly
            assert ratios["bias"] > 1 - 1e-9


def test_conv_bounds_cover_the_exact_operator_norm():
    torch.manual_seed(0)
    for config in CONVS:
        cin, cout, k, hw, stride, padding, dilation, _ = config
        layer = WeightClipConv2d(cin, cout, k, hw, stride, padding, dilation, max_norm=7.0)
        with torch.no_grad():
            layer.weight.normal_()
        exact, _ = conv_operator_norm(layer.weight.detach().double(), (cin, *hw), stride=(stride, stride),
                                      padding=(padding, padding), dilation=(dilation, dilation), iters=300)  # fmt: skip
        assert float(exact) <= float(layer.lipschitz()), config


def test_conv_projection_clips_only_above_c_and_fixed_always_rescales():
    torch.manual_seed(0)
    layer = WeightClipConv2d(3, 4, 3, (6, 6), padding=1, max_norm=2.0)
    assert float(layer.lipschitz()) <= 2.0 * (1 + 1e-6)  # projected at construction
    with torch.no_grad():
        layer.weight.mul_(0.1)
    before = layer.weight.detach().clone()
    project_(layer)
    assert torch.equal(layer.weight, before), "a kernel below C must be unchanged"
    with torch.no_grad():
        layer.weight.normal_(std=5.0)
    direction = layer.weight.detach() / layer.weight.detach().norm()
    project_(layer)
    assert float(layer.lipschitz()) == pytest.approx(2.0, rel=1e-5)
    torch.testing.assert_close(layer.weight.detach() / layer.weight.detach().norm(), direction)
    exact, _ = conv_operator_norm(layer.weight.detach().double(), (3, 6, 6), padding=(1, 1), iters=300)
    assert float(exact) <= 2.0 * (1 + 1e-5)
    fixed = WeightClipConv2d(3, 4, 3, (6, 6), padding=1, projection="fixed", max_norm=2.0)
    with torch.no_grad():
        fixed.weight.mul_(1e-3)
    project_(fixed)
    assert float(fixed.lipschitz()) == pytest.approx(2.0, rel=1e-5)
    zero = WeightClipConv2d(1, 1, 3, (4, 4), projection="fixed")
    with torch.no_grad():
        zero.weight.zero_()
    project_(zero)
    assert torch.equal(zero.weight, torch.zeros_like(zero.weight)), "a zero kernel stays 0, not NaN"


def test_conv_refuses_wrong_shapes_and_arguments():
    layer = WeightClipConv2d(1, 2, 3, (6, 6), padding=1, bias=True)
    with pytest.raises(ValueError, match=r"built for 6x6 inputs"):
        layer(torch.randn(2, 1, 8, 8))
    with pytest.raises(ValueError, match="unknown projection 'orthogonal'.*LipschitzConv2d"):
        WeightClipConv2d(1, 2, 3, (6, 6), projection="orthogonal")
    with pytest.raises(ValueError, match="max_norm"):
        WeightClipConv2d(1, 2, 3, (6, 6), max_norm=0.0)
    with pytest.raises(ValueError, match="no output position"):
        WeightClipConv2d(1, 2, 5, (3, 3))


# ------------------------------------------------------------------------------------------------- group norm


def _group_norm_reference(x: torch.Tensor, groups: int, alpha: float) -> torch.Tensor:
    g = x.reshape(x.shape[0], groups, -1)
    mu = g.mean(-1, keepdim=True)
    sigma = ((g - mu) ** 2).mean(-1, keepdim=True).sqrt()
    return ((g - mu) / torch.clamp(sigma, min=alpha)).reshape(x.shape)


GROUP_NORMS = [  # (groups, channels, spatial shape, spatial given to the layer)
    (2, 8, (), False),
    (4, 8, (5,), False),
    (3, 6, (4, 4), True),
    (1, 4, (3, 3), True),
]


def _group_norm_inputs(shape: tuple[int, ...], groups: int, x_bound: float, gen: torch.Generator) -> torch.Tensor:
    """Random rows; rows centred per group (the 1/alpha regime is tight on them); constant rows (every group has
    sigma 0); rows whose first group is constant, second tiny and the rest huge; all on the X sphere (float64)."""
    random = torch.randn(4, *shape, generator=gen, dtype=torch.float64)
    centred = random[:2].reshape(2, groups, -1)
    centred = (centred - centred.mean(-1, keepdim=True)).reshape(2, *shape)
    constant = torch.full((2, *shape), 3.0, dtype=torch.float64)
    constant[1] = -1.0
    mixed = torch.randn(2, groups, math.prod(shape) // groups, generator=gen, dtype=torch.float64) * 1e6
    mixed[:, 0] = 5.0
    if groups > 1:
        mixed[:, 1] *= 1e-12
    x = torch.cat([random, centred, constant, mixed.reshape(2, *shape)])
    return _on_sphere(x, x_bound)


@pytest.mark.parametrize("config", GROUP_NORMS, ids=lambda c: f"{c[0]}g{c[1]}c{'x'.join(map(str, c[2]))}{c[3]}")
@pytest.mark.parametrize("alpha", [0.1, 1.0, 10.0])
def test_group_norm_rules_hold(config, alpha):
    groups, channels, spatial, given = config
    gen = torch.Generator().manual_seed(2)
    layer = LipschitzGroupNorm(groups, channels, alpha=alpha, spatial_shape=spatial if given else None)
    shape = (channels, *spatial)
    tight = []
    # X tiny: every group has sigma below alpha (y = centred x / alpha); X huge: above (||y_g|| = sqrt(n))
    for x_bound in (1e-3, 1.0, 50.0, 1e5):
        x = _group_norm_inputs(shape, groups, x_bound, gen)
        y = layer(x)
        torch.testing.assert_close(y, _group_norm_reference(x, groups, alpha), rtol=1e-12, atol=1e-300,
                                   msg=lambda m: f"(x - mu) / max(alpha, sigma): {m}")  # fmt: skip
        assert y[6:8].abs().max() <= 1e-12 * x_bound / alpha  # constant rows: 0 up to the rounding of the mean
        u = torch.randn(x.shape, generator=gen, dtype=torch.float64)
        g = u.reshape(u.shape[0], groups, -1)
        u = _on_sphere((g - g.mean(-1, keepdim=True)).reshape(u.shape), 2.0)  # centred: no part lost to the mean
        ratios = layer_ratios(layer, x, u, x_bound, 2.0)
        assert_within(ratios, SLACK64, f"{config} alpha={alpha} X={x_bound}")
        tight.append(ratios)
    # the centred rows with sigma < alpha meet both 1/alpha rules; huge inputs meet sqrt(N) where it is given
    assert tight[0]["output"] > 1 - 1e-9 and tight[0]["input"] > 1 - 1e-6
    if given:
        assert tight[-1]["output"] > 1 - 1e-9


def test_group_norm_is_one_over_alpha_lipschitz():
    """The paper's acceptance check: the Jacobian's spectral norm (exact, jacrev + svdvals) is <= 1/alpha at points
    on both sides of the max, and for pairs across it ||f(x) - f(x')|| <= ||x - x'|| / alpha."""
    gen = torch.Generator().manual_seed(3)
    alpha = 0.5
    layer = LipschitzGroupNorm(2, 4, alpha=alpha, spatial_shape=(3,))
    worst = 0.0
    for scale in (1e-2, 0.3, 0.6, 3.0, 1e3):
        x = scale * torch.randn(1, 4, 3, generator=gen, dtype=torch.float64)
        jac = jacrev(layer)(x).reshape(12, 12)
        worst = max(worst, float(torch.linalg.svdvals(jac).max()))
    assert worst <= (1 / alpha) * SLACK64 and worst > (1 / alpha) * (1 - 1e-9)
    a = torch.randn(500, 4, 3, generator=gen, dtype=torch.float64) * torch.logspace(-2, 2, 500, dtype=torch.float64)[
        :, None, None]  # fmt: skip
    b = a + torch.randn(500, 4, 3, generator=gen, dtype=torch.float64) * 0.7
    lhs = (layer(a) - layer(b)).flatten(1).norm(dim=1)
    assert (lhs <= (a - b).flatten(1).norm(dim=1) / alpha * SLACK64).all()


def test_group_norm_is_finite_at_extreme_scales_in_float32():
    layer = LipschitzGroupNorm(2, 4, alpha=1.0, spatial_shape=(2,))
    for scale in (1e-30, 1e30):
        x = (scale * torch.randn(3, 4, 2)).requires_grad_()
        y = layer(x)
        (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), x)
        assert torch.isfinite(y).all() and torch.isfinite(g).all()
        assert (y.flatten(1).norm(dim=1) <= math.sqrt(8) * SLACK32).all()


def test_group_norm_refuses_wrong_shapes_and_arguments():
    layer = LipschitzGroupNorm(2, 4, spatial_shape=(3, 3))
    with pytest.raises(ValueError, match=r"spatial shape \(3, 3\)"):
        layer(torch.randn(2, 4, 4, 4))
    with pytest.raises(ValueError, match=r"\[B, 4, \*spatial\]"):
        layer(torch.randn(2, 5, 3, 3))
    with pytest.raises(ValueError, match="multiple of num_groups"):
        LipschitzGroupNorm(3, 4)
    with pytest.raises(ValueError, match="alpha"):
        LipschitzGroupNorm(2, 4, alpha=0.0)


# ------------------------------------------------------------------------------------------------ activations


@pytest.mark.parametrize("kind", ["sigmoid", "tanh", "tanh-features"])
def test_activation_rules_hold(kind):
    gen = torch.Generator().manual_seed(4)
    features = 12
    layer = {"sigmoid": lambda: LipschitzSigmoid(features), "tanh": LipschitzTanh,
             "tanh-features": lambda: LipschitzTanh(features)}[kind]()  # fmt: skip
    shape = (3, 4)
    ratios_by_x = {}
    for x_bound in (1e-6, 1.0, 4.0, 20.0, 1e4):
        random = torch.randn(4, *shape, generator=gen, dtype=torch.float64)
        saturated = torch.sign(random[:2]) * 1e3  # sigmoid(-1e3) = 0, derivative 0
        ones = torch.ones(2, *shape, dtype=torch.float64)
        x = _on_sphere(torch.cat([random, saturated, ones, -ones]), x_bound)
        x = torch.cat([x, torch.zeros(1, *shape, dtype=torch.float64)])  # sigmoid(0) = 1/2, derivative 1/4
        u = _on_sphere(torch.randn(x.shape, generator=gen, dtype=torch.float64), 3.0)
        u[-1] = _on_sphere(torch.ones(1, *shape, dtype=torch.float64), 3.0)[0]
        ratios_by_x[x_bound] = layer_ratios(layer, x, u, x_bound, 3.0)
        assert_within(ratios_by_x[x_bound], SLACK64, f"{kind} X={x_bound}")
    # tight at 0 (derivative 1/4 for sigmoid, 1 for tanh); sigmoid's output bound sqrt(N)/2 + X/4 as X -> 0
    assert ratios_by_x[1e-6]["input"] > 1 - 1e-9
    if kind == "sigmoid":
        assert ratios_by_x[1e-6]["output"] > 1 - 1e-6
        assert float(layer.propagate(1e4)) == pytest.approx(math.sqrt(features))  # the |sigmoid| <= 1 cap
        assert float(layer.propagate(math.inf)) == pytest.approx(math.sqrt(features))
    if kind == "tanh":
        assert ratios_by_x[1e-6]["output"] > 1 - 1e-6


def test_activations_refuse_another_feature_count():
    with pytest.raises(ValueError, match="built for examples of 12 coordinates"):
        LipschitzSigmoid(12)(torch.randn(2, 13))
    with pytest.raises(ValueError, match="built for examples of 12 coordinates"):
        LipschitzTanh(12)(torch.randn(2, 3, 5))
    assert LipschitzTanh()(torch.randn(2, 3, 5)).shape == (2, 3, 5)


# --------------------------------------------------------------------------------------------------- residual


@pytest.mark.parametrize("kind", ["conv", "dense", "identity", "clip-gradient"])
def test_residual_sum_rules_hold(kind):
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(5)
    if kind == "conv":
        block = [WeightClipConv2d(2, 2, 3, (5, 5), padding=1, bias=True, max_norm=3.0), LipschitzGroupNorm(1, 2),
                 LipschitzTanh()]  # fmt: skip
        shape = (2, 5, 5)
    else:
        dense = LipschitzLinear(6, 6, bias=True, projection="clip", max_norm=10.0)
        with torch.no_grad():
            dense.weight.copy_(torch.eye(6) if kind == "identity" else 4.0 * torch.randn(6, 6))
            dense.bias.copy_(torch.zeros(6) if kind == "identity" else torch.randn(6))
        block = [dense, nn.ReLU()] if kind == "dense" else [dense]
        block += [ClipGradient(0.3)] if kind == "clip-gradient" else []
        shape = (6,)
    layer = ResidualSum(*block).double()
    for x_bound in (0.01, 2.0, 100.0):
        x = _on_sphere(torch.randn(8, *shape, generator=gen, dtype=torch.float64), x_bound)
        u = _on_sphere(torch.randn(8, *shape, generator=gen, dtype=torch.float64), 1.5)
        ratios = layer_ratios(layer, x, u, x_bound, 1.5)
        assert_within(ratios, SLACK64, f"{kind} X={x_bound}")
        torch.testing.assert_close(layer(x), x + layer.block(x))
        if kind == "identity":  # y = 2 x: eq. 7's 1 + 1 and X + X are met (up to the certified norm of I, ~1 + 1e-4)
            assert ratios["input"] > 1 - 1e-3 and ratios["output"] > 1 - 1e-3
    assert isinstance(layer, Residual)  # fastdp.nn.validate walks its block


# ---------------------------------------------------------------------------------------------------- networks


def _network(max_norm: float) -> nn.Module:
    """Every new layer in one chain, with a ClipGradient-free residual and a sigmoid head."""
    return nn.Sequential(
        BoundedInput(6.0),
        WeightClipConv2d(1, 4, 3, (6, 6), padding=1, bias=True, max_norm=max_norm),
        LipschitzGroupNorm(2, 4, alpha=0.5, spatial_shape=(6, 6)),
        nn.ReLU(),
        ResidualSum(WeightClipConv2d(4, 4, 3, (6, 6), padding=1, max_norm=max_norm), LipschitzTanh()),
        L2NormPool2d(2),
        WeightClipConv2d(4, 6, 3, (3, 3), stride=2, padding=1, bias=True, max_norm=max_norm),
        nn.Flatten(),
        LipschitzSigmoid(24),
        LipschitzLinear(24, 5, bias=True, projection="clip", max_norm=max_norm),
    )


def test_network_of_new_layers_stays_within_its_bounds_during_projected_training():
    torch.manual_seed(6)
    model = _network(max_norm=1.7)
    loss = TauCrossEntropy(4.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    for round_ in range(4):
        x = torch.randn(36, 1, 6, 6)
        board = ((torch.arange(6)[:, None] + torch.arange(6)) % 2 * 2.0 - 1).expand(4, 1, 6, 6)
        x = torch.cat([_on_sphere(x[:16], 6.0), 1e3 * x[16:28], torch.ones(4, 1, 6, 6), torch.zeros(4, 1, 6, 6),
                       _on_sphere(board, 6.0)])  # fmt: skip
        y = torch.randint(0, 5, (40,))
        bounds = lipschitz_bounds(model, loss)
        for p, n in per_example_grad_norms(model, loss, x, y).items():
            assert n.max() <= float(bounds[p]) * SLACK32, f"round {round_}: {n.max()} > {bounds[p]}"
        optimizer.zero_grad()
        (loss(model(x), y).sum() * 10).backward()
        optimizer.step()
        project_(model)
        for m in model.modules():
            if isinstance(m, WeightClipConv2d):
                assert float(m.lipschitz()) <= 1.7 * (1 + 1e-5)


def test_refusals_name_the_new_layers():
    with pytest.raises(ValueError, match=r"1 \(Sigmoid\).*fastdp\.nn\.weightclip: .*LipschitzSigmoid"):
        lipschitz_bounds(nn.Sequential(BoundedInput(1.0), nn.Sigmoid(), LipschitzLinear(4, 2)), TauCrossEntropy())
    from fastdp.nn.validate import validate

    model = nn.Sequential(BoundedInput(1.0), ResidualSum(nn.Linear(4, 4)), LipschitzLinear(4, 2))
    problems = validate(model, "weightclip")
    assert [(p.module, p.kind) for p in problems] == [("1.block.0", "no-lipschitz-rule")]
    with pytest.raises(ValueError, match="no Lipschitz bound rule"):
        lipschitz_bounds(model, TauCrossEntropy())


@pytest.mark.parametrize("layer, x", [
    (WeightClipConv2d(2, 3, 3, (5, 5), padding=1, bias=True), torch.randn(2, 2, 5, 5)),
    (LipschitzGroupNorm(2, 4, alpha=0.5, spatial_shape=(3,)), torch.randn(2, 4, 3)),
    (LipschitzSigmoid(6), torch.randn(2, 6)),
    (LipschitzTanh(6), torch.randn(2, 6)),
    (ResidualSum(LipschitzLinear(6, 6), nn.ReLU()), torch.randn(2, 6)),
], ids=["conv", "group-norm", "sigmoid", "tanh", "residual"])  # fmt: skip
def test_compile_fullgraph_smoke(layer, x):
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = x.requires_grad_()
    out = compiled(x)
    torch.testing.assert_close(out, layer(x))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


# ---------------------------------------------------------------------------------------------------- end to end


def test_weightclip_variant_trains_weightclip_cnn():
    """A few WeightClip steps on weightclip_cnn: before each, every example's gradient is within the variant's
    Delta_l; after each, the projection keeps every conv's certified constant and the classifier's norm <= C."""
    torch.manual_seed(7)
    c = 1.5
    model = build_model("weightclip_cnn", (1, 8, 8), 10, input_bound=8.0, max_weight_norm=c)
    assert lipschitz_bounds(model, TauCrossEntropy())  # every layer has a rule
    variant = WeightClip(1.0, 0.25, 64, reproducible_seed=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    for step in range(3):
        x = torch.cat([torch.randn(12, 1, 8, 8), 1e3 * torch.randn(4, 1, 8, 8)])
        y = torch.randint(0, 10, (16,))
        variant.gradient(model, Batch(x, y, torch.ones(16, dtype=torch.bool)), step)
        deltas = dict(zip([p for p in model.parameters() if p.requires_grad], variant.last_bounds.tolist(),
                          strict=True))  # fmt: skip
        for p, n in per_example_grad_norms(model, variant.loss_fn, x, y).items():
            assert n.max() <= deltas[p] * SLACK32
        optimizer.step()
        variant.after_step(model)
        for m in model.modules():
            if isinstance(m, WeightClipConv2d):
                assert float(m.lipschitz()) <= c * (1 + 1e-5)
            if isinstance(m, LipschitzLinear):
                assert float(torch.linalg.matrix_norm(m.weight.detach().double(), 2)) <= c * (1 + 1e-5)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_weightclip_cnn_trains_through_the_trainer():
    from fastdp.train.trainer import TrainConfig, train

    result = train(TrainConfig(variant="weightclip", model="weightclip_cnn", dataset="digits", epsilon=4.0,
                               delta=1e-4, epochs=1, batch_size=256, optimizer="adam", lr=0.01, max_weight_norm=1.0,
                               quiet=True, progress=False, reproducible_privacy_seed=0))  # fmt: skip
    assert result["variant"] == "weightclip" and result["epsilon"] <= 4.0
    bounds = result["variant_config"]["gradient_bounds"]
    assert len(bounds) == 4 and all(math.isfinite(b) and b > 0 for b in bounds)  # 2 convs, linear weight and bias
    assert 0.0 <= result["test_accuracy"] <= 1.0


def test_weightclip_cnn_refuses_non_images():
    with pytest.raises(ValueError, match="weightclip_cnn is for images"):
        build_model("weightclip_cnn", (30,), 3)


def test_the_fuzzer_measures_the_new_layers_within_their_bounds():
    """The sensitivity fuzzer's weightclip-layers architecture (fastdp.audit.fuzz): each example's leave-one-out change
    of the noiseless release is within the claimed bound, through the variant and through the front door."""
    from fastdp.audit import fuzz

    variants = ("weightclip", "front-door-weightclip", "clipless")
    report = fuzz.run_fuzz(12, fuzz_seed=1, architectures_=("weightclip-layers",), variants=variants,
                           precisions=("fp32", "fp64"))  # fmt: skip
    assert report.passed, fuzz.format_report(report)
    assert sum(o.status == "ok" for o in report.outcomes) >= 6


def test_weightclip_cnn_step_reads_no_device_value_on_the_host(monkeypatch):
    """The bounds, the noise and the projections of the new layers never turn a tensor into a Python value (on CPU
    every such read is made to fail, as in tests/test_lipschitz.py)."""
    torch.manual_seed(0)
    model = _network(max_norm=2.0)
    variant = WeightClip(1.0, 0.1, 60)
    batch = Batch(torch.randn(6, 1, 6, 6), torch.randint(0, 5, (6,)), torch.ones(6, dtype=torch.bool))
    steps_without_host_reads(monkeypatch, variant, model, batch)
