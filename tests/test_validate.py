"""fastdp.nn.validate / fix / is_valid (Opacus' ModuleValidator for fastdp's variants) and the refusals they share
with the variants' per-step checks (docs/validate.md)."""

import copy
import importlib

import pytest
import torch
from torch import nn

import fastdp.nn as dpnn
from fastdp.algorithms import DPSGD, Batch
from fastdp.algorithms.base import LOW_PRECISION_PARAMETERS_DPSGD
from fastdp.algorithms.dpsgd import clipped_gradient_sum, ghost_clipped_gradient_sum, per_example_cross_entropy
from fastdp.nn import Problem, UnsupportedLayerError, fix, is_valid, validate
from fastdp.nn.lipschitz import BoundedInput, GroupSort2, LipschitzLinear, Residual
from fastdp.train.models import build_model
from tests.variants import make_variant

validation = importlib.import_module("fastdp.nn.validate")  # the module (fastdp.nn.validate is the function)

PRIVATE = ("dpsgd", "dpsgd-reference", "jl", "backprop", "clipless", "weightclip")


def _batch(x: torch.Tensor, classes: int = 10) -> Batch:
    return Batch(x, torch.randint(0, classes, (x.shape[0],)), torch.ones(x.shape[0], dtype=torch.bool))


# ------------------------------------------------------------------------------------------------------ models


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, written out (torchvision is not imported: its wheels may not load)."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + identity)


class TinyResNet(nn.Module):
    """A ResNet-style stem, two BasicBlocks (one downsampling, 48 channels: not a multiple of 32) and a head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(16, 16), BasicBlock(16, 48, stride=2))
        self.fc = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


def _batch_norms(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# --------------------------------------------------------------------------------------------------- fix()


def test_fix_replaces_every_batch_norm_of_a_resnet_with_group_norm_in_place():
    torch.manual_seed(0)
    model = TinyResNet()
    bns = {n: model.get_submodule(n) for n in _batch_norms(model)}
    assert len(bns) == 6
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before fix: must keep working
    assert fix(model) is model
    assert _batch_norms(model) == []
    for name, bn in bns.items():
        gn = model.get_submodule(name)
        assert type(gn) is nn.GroupNorm and gn.num_channels == bn.num_features and gn.eps == bn.eps
        assert gn.num_groups == {16: 16, 48: 24}[bn.num_features]  # largest divisor <= 32 (Opacus: min(32, C))
        assert gn.weight is bn.weight and gn.bias is bn.bias  # the same Parameters: their meaning is kept
        assert gn.training
    assert validate(model) == [] and is_valid(model, "dpsgd") and is_valid(model, "jl")
    # DP-SGD trains the fixed model, and the optimizer built before fix() steps the GroupNorms' Parameters
    x = torch.randn(6, 3, 8, 8)
    DPSGD(1.0, 1.0, 0.1, 100, reproducible_seed=0).gradient(model, _batch(x), 0)
    before = model.bn1.weight.detach().clone()
    optimizer.step()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    assert not torch.equal(before, model.bn1.weight)


def test_fixed_resnet_is_per_example_and_its_ghost_and_reference_sums_agree():
    """The GroupNorm model in training mode: one example's output does not depend on the batch, and DP-SGD's ghost
    clipping gives torch.func's per-example clipped sum."""
    torch.manual_seed(0)
    model = fix(TinyResNet()).double()
    x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(model(x)[:1], model(x[:1]))
    batch = _batch(x)
    reference, _ = clipped_gradient_sum(model, per_example_cross_entropy, batch, 0.5)
    ghost, _ = ghost_clipped_gradient_sum(dpnn.convert(model), per_example_cross_entropy, batch, 0.5)
    for a, b in zip(ghost, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_fixed_group_norm_equals_a_hand_built_group_norm():
    """The output of a fixed BatchNorm layer is GroupNorm's with the BatchNorm's affine weight and bias."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(48, eps=1e-3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    model = fix(nn.Sequential(nn.Conv2d(3, 48, 3), bn))
    x = torch.randn(4, 3, 6, 6)
    expected = nn.functional.group_norm(model[0](x), 24, bn.weight, bn.bias, 1e-3)
    torch.testing.assert_close(model(x), expected)


def test_batch_norm_1d_becomes_one_group_and_groups_can_be_chosen():
    """BatchNorm1d also sees [B, C] inputs: GroupNorm(min(32, C), C) would normalise groups of one value to 0 (every
    output = bias), so fix() uses one group there (a LayerNorm over the features with per-feature affine)."""
    torch.manual_seed(0)
    model = fix(nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)))
    assert model[1].num_groups == 1
    h = model[0](torch.randn(5, 4))
    torch.testing.assert_close(model[1](h), nn.functional.layer_norm(h, (8,)) * model[1].weight + model[1].bias)
    degenerate = nn.GroupNorm(8, 8)
    assert degenerate(h).abs().max() < 1e-4  # Opacus' choice for [B, C] inputs
    model = nn.Sequential(nn.Conv2d(3, 12, 1), nn.BatchNorm2d(12), nn.Conv2d(12, 6, 1), nn.BatchNorm2d(6))
    fix(model, groups=3)
    assert [model[1].num_groups, model[3].num_groups] == [3, 3]
    with pytest.raises(ValueError, match=r"groups=5 does not divide the 12 channels of 1 \(BatchNorm2d\)"):
        fix(nn.Sequential(nn.Conv2d(3, 12, 1), nn.BatchNorm2d(12)), groups=5)


def test_fix_keeps_modes_affine_less_layers_shared_modules_and_a_batch_norm_model():
    shared = nn.BatchNorm2d(4, affine=False)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), shared, nn.Conv2d(4, 4, 1), shared).eval()
    fix(model)
    assert model[1] is model[3] and type(model[1]) is nn.GroupNorm  # one replacement for the one module
    assert not model[1].affine and model[1].weight is None and not model[1].training
    assert fix(nn.BatchNorm1d(3)).__class__ is nn.GroupNorm  # the model itself: a new module is returned
    assert fix(nn.SyncBatchNorm(64)).num_groups == 32
    with pytest.raises(ValueError, match="lazy layer not yet initialised; run one forward first"):
        fix(nn.Sequential(nn.LazyBatchNorm1d()))


def test_fix_turns_instance_norm_running_statistics_off():
    """InstanceNorm: for dpsgd/jl a trainable affine one becomes GroupNorm(C, C) (a DP layer, the same function);
    otherwise the same class without running statistics. Outputs equal the original's in training mode."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 5, 5)
    for variant, expected in (("dpsgd", nn.GroupNorm), ("backprop", nn.InstanceNorm2d)):
        norm = nn.InstanceNorm2d(6, affine=True, track_running_stats=True)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 2.0)
            norm.bias.uniform_(-1.0, 1.0)
        original = copy.deepcopy(norm)
        model = fix(nn.Sequential(norm), variant)
        assert type(model[0]) is expected and model[0].weight is norm.weight
        assert not getattr(model[0], "track_running_stats", False) and validate(model, variant) == (
            [] if variant == "dpsgd" else validate(model, variant)
        )
        assert not any(validation.mixes_examples(m) for m in model.modules())
        torch.testing.assert_close(model(x), original(x))
        torch.testing.assert_close(model(x[:1]), model(x)[:1])
    plain = nn.Sequential(nn.InstanceNorm2d(6))  # no running statistics, no parameters: already valid, kept
    kept = plain[0]
    assert fix(plain)[0] is kept


def test_fix_makes_the_exact_small_repairs():
    torch.manual_seed(0)
    # a frozen max_norm Embedding: every row renormalised once, max_norm dropped, the same outputs
    emb = nn.Embedding(10, 4, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(3.0)
    emb.requires_grad_(False)
    original = copy.deepcopy(emb)
    idx = torch.randint(0, 10, (5, 3))
    model = fix(nn.Sequential(emb))
    assert emb.max_norm is None
    weights = emb.weight.clone()
    torch.testing.assert_close(model(idx), original(idx))
    assert torch.equal(emb.weight, weights)  # the forward writes nothing into the model any more
    # a trainable sparse Embedding becomes dense
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True))
    assert [p.kind for p in validate(sparse)] == ["embedding-sparse"]
    assert not fix(sparse)[0].sparse and is_valid(sparse)
    # padding='same' with an odd kernel: the equal integer padding; an even kernel cannot be
    conv = nn.Conv2d(2, 3, (3, 5), padding="same", dilation=(1, 2))
    x = torch.randn(2, 2, 7, 9)
    before = conv(x)
    fix(nn.Sequential(conv))
    assert conv.padding == (1, 4)
    torch.testing.assert_close(conv(x), before)
    even = nn.Sequential(nn.Conv2d(2, 3, 4, padding="same"))
    fix(even)
    assert even[0].padding == "same" and [(p.kind, p.fixable) for p in validate(even)] == [("padding-same", False)]


def test_fix_for_nonprivate_changes_nothing():
    model = TinyResNet()
    assert fix(model, "nonprivate") is model and len(_batch_norms(model)) == 6
    assert validate(model, "nonprivate") == []


# ----------------------------------------------------------------------------------------------- validate()


class Scale(nn.Module):
    """A module with its own trainable Parameter (no DP layer holds it)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(features))
        self.inner = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * self.scale


def test_validate_lists_every_problem_at_once_in_model_order():
    torch.manual_seed(0)
    tied = nn.Linear(8, 8)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular"),  # 0
        nn.BatchNorm2d(8),  # 1
        nn.Flatten(2),  # 2
        nn.LSTMCell(4, 4),  # 3
        Scale(8),  # 4
        tied,  # 5
        tied,  # 6: one layer registered twice
        nn.Embedding(10, 8, max_norm=1.0),  # 7
    )
    model[5].half()
    problems = validate(model, "dpsgd")
    found = [(p.module, p.module_type, p.kind, p.fixable) for p in problems]
    assert found == [
        ("0", "Conv2d", "padding-mode", False),
        ("1", "BatchNorm2d", "batch-statistics", True),
        ("1", "BatchNorm2d", "unsupported-layer", True),
        ("3", "LSTMCell", "unsupported-layer", False),
        ("4", "Scale", "unsupported-layer", False),
        ("5", "Linear", "low-precision", False),
        ("7", "Embedding", "embedding-max-norm", False),
    ]
    assert all(isinstance(p, Problem) and p.what and p.alternative for p in problems)
    text = {p.kind + p.module: str(p) for p in problems}
    assert "padding_mode='circular'" in text["padding-mode0"]
    assert "F.pad(x, ..., mode='circular')" in text["padding-mode0"]
    assert "nn.LSTM over the whole sequence (a DP layer)" in text["unsupported-layer3"]
    assert "move the parameter into a supported layer" in text["unsupported-layer4"]
    assert "weight (float16), bias (float16)" in text["low-precision5"]
    assert "set_precision('bf16')" in text["low-precision5"]
    assert "which tokens the batch held" in text["embedding-max-norm7"]
    assert str(problems[1]).startswith("1 (BatchNorm2d): uses the batch's statistics") and str(problems[1]).endswith(
        "[fastdp.nn.fix repairs this]"
    )
    # DP-SGD norms the sum of a shared layer's uses; backprop clipping would credit each use with one use's bound
    shared = [p for p in validate(model, "backprop") if p.kind == "shared-parameter"]
    assert [p.module for p in shared] == ["6"]
    assert "weight (also 5.weight), bias (also 5.bias) (tied weights, or one layer" in str(shared[0])


def test_strict_raises_one_error_naming_them_all():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.GRUCell(4, 4), nn.Embedding(3, 4, sparse=True))
    problems = validate(model)
    with pytest.raises(UnsupportedLayerError) as err:
        validate(model, strict=True)
    assert err.value.problems == problems and len(problems) == 4
    text = str(err.value)
    assert text.startswith("variant 'dpsgd' cannot train this model as it is (4 problems):\n  1 (BatchNorm1d)")
    assert all(str(p) in text for p in problems)
    assert "fastdp.nn.fix(model, 'dpsgd') repairs the 3 marked" in text
    assert isinstance(err.value, ValueError)
    fix(model)
    with pytest.raises(UnsupportedLayerError, match=r"\(1 problems\):\n  2 \(GRUCell\)") as err:
        validate(model, "jl", strict=True)
    assert "repairs" not in str(err.value)  # nothing left that fix() repairs
    assert validate(nn.Linear(2, 2), strict=True) == []


def test_lipschitz_variants_list_layers_without_a_rule_including_residual_blocks():
    torch.manual_seed(0)
    model = nn.Sequential(BoundedInput(1.0), LipschitzLinear(4, 4), Residual(LipschitzLinear(4, 4), nn.Tanh()),
                          nn.Dropout(0.1), nn.Linear(4, 2))  # fmt: skip
    for variant in ("clipless", "weightclip"):
        found = [(p.module, p.module_type, p.kind) for p in validate(model, variant)]
        assert found == [("2.block.1", "Tanh", "no-lipschitz-rule"), ("3", "Dropout", "no-lipschitz-rule"),
                         ("4", "Linear", "no-lipschitz-rule")]  # fmt: skip
        texts = [p.alternative for p in validate(model, variant)]
        assert "GroupSort2" in texts[0] and "LipschitzLinear" in texts[2]
    model[2].block[1] = GroupSort2()
    del model[3:]
    assert is_valid(model, "clipless") and not is_valid(model, "dpsgd")  # LipschitzLinear is not a DP layer
    custom = [(p.module, p.alternative) for p in validate(TinyResNet(), "clipless")]
    assert custom[0][0] == "" and "nn.Sequential" in custom[0][1]


def test_validate_takes_variant_objects_and_refuses_unknown_names():
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding="same"), Scale(2))
    assert validate(model, DPSGD(1.0, 1.0, 0.1, 10, mode="reference")) == validate(model, "dpsgd-reference") == []
    assert validate(model, DPSGD(1.0, 1.0, 0.1, 10)) == validate(model, "dpsgd") != []
    assert validate(model, make_variant("backprop", 2, 10)) == validate(model, "backprop")
    with pytest.raises(ValueError, match="unknown variant 'opacus'; choose one of dpsgd, dpsgd-reference, jl"):
        validate(model, "opacus")


def test_validate_reads_the_current_mode():
    """As the per-step checks: a frozen BatchNorm in eval mode with running statistics is a fixed per-channel map."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].requires_grad_(False)
    assert [p.kind for p in validate(model)] == ["batch-statistics"]
    model.eval()
    assert validate(model) == []
    model[1].track_running_stats = False
    assert [p.kind for p in validate(model)] == ["batch-statistics"]


# ----------------------------------------------------------------- each variant's accepted set, against the steps


def _tied() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Flatten(), nn.Linear(8, 10))
    model[2].weight = model[0].weight
    return model


def _frozen_max_norm() -> nn.Module:
    model = nn.Sequential(nn.Embedding(10, 8, max_norm=1.0), nn.Flatten(), nn.Linear(24, 10))
    with torch.no_grad():
        model[0].weight.mul_(3.0)  # every row beyond max_norm
    model[0].requires_grad_(False)
    return model


def _frozen_eval_batch_norm() -> nn.Module:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 10))
    model[1].requires_grad_(False).eval()
    return model


def _lipschitz() -> nn.Module:
    return build_model("lipschitz_mlp", (8,), 10, hidden=8, input_bound=4.0)


IMAGE, TOKENS, VECTOR = (3, 5, 5), "tokens", (8,)
MODELS = {  # name: (model builder, input kind)
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10)), VECTOR),
    "conv-batch-norm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(36, 10)),
                        IMAGE),
    "conv-frozen-eval-batch-norm": (_frozen_eval_batch_norm, IMAGE),
    "layer-norm": (lambda: nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10)), VECTOR),
    "group-norm": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.GroupNorm(2, 4), nn.Flatten(), nn.Linear(36, 10)),
                   IMAGE),
    "instance-norm-affine": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True),
                                                   nn.Flatten(), nn.Linear(36, 10)), IMAGE),
    "instance-norm-running": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, track_running_stats=True),
                                                    nn.Flatten(), nn.Linear(36, 10)), IMAGE),
    "embedding": (lambda: nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(24, 10)), TOKENS),
    "embedding-sparse": (lambda: nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Flatten(), nn.Linear(24, 10)),
                         TOKENS),
    "embedding-frozen-max-norm": (_frozen_max_norm, TOKENS),
    "conv-circular": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular"), nn.Flatten(),
                                            nn.Linear(100, 10)), IMAGE),
    "conv-same": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3, padding="same"), nn.Flatten(), nn.Linear(100, 10)), IMAGE),
    "own-parameter": (lambda: nn.Sequential(nn.Linear(8, 8), Scale(8), nn.Linear(8, 10)), VECTOR),
    "tied": (_tied, VECTOR),
    "lipschitz-mlp": (_lipschitz, VECTOR),
    "bf16-lipschitz-mlp": (lambda: _lipschitz().bfloat16(), VECTOR),
    "bf16-mlp": (lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 10)).bfloat16(), VECTOR),
}  # fmt: skip

ACCEPTED = {  # what each variant's step accepts (and validate() must say so)
    "dpsgd": {"mlp", "conv-frozen-eval-batch-norm", "layer-norm", "group-norm", "embedding", "tied"},
    "jl": {"mlp", "conv-frozen-eval-batch-norm", "layer-norm", "group-norm", "embedding", "tied"},
    "dpsgd-reference": {"mlp", "conv-frozen-eval-batch-norm", "layer-norm", "group-norm", "embedding",
                        "instance-norm-affine", "conv-circular", "conv-same", "own-parameter", "tied",
                        "lipschitz-mlp"},
    "backprop": {"mlp", "conv-frozen-eval-batch-norm", "conv-same"},
    "clipless": {"lipschitz-mlp"},
    "weightclip": {"lipschitz-mlp"},
    "nonprivate": set(MODELS),
}  # fmt: skip


def _input(kind, rows: int = 4) -> torch.Tensor:
    if kind == TOKENS:
        return torch.randint(0, 10, (rows, 3))
    return torch.randn(rows, *kind)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # torch.func on a sparse embedding, refused
@pytest.mark.parametrize("variant", list(ACCEPTED))
def test_each_variant_accepts_what_validate_accepts(variant):
    """For every model of the catalogue: validate() finds nothing exactly when the variant's step runs (and when it
    finds something, the step refuses before releasing anything)."""
    for name, (build, kind) in MODELS.items():
        torch.manual_seed(0)
        model, x = build(), _input(kind)
        expected = name in ACCEPTED[variant]
        assert is_valid(model, variant) == expected, (name, validate(model, variant))
        algorithm = make_variant(variant, 4, 40)
        try:
            algorithm.gradient(model, _batch(x.to(torch.bfloat16) if "bf16" in name and kind != TOKENS else x), 0)
            ran = True
        except (ValueError, RuntimeError, NotImplementedError):
            ran = False
        assert ran == expected, (variant, name)


@pytest.mark.parametrize("variant", ["dpsgd", "jl", "backprop"])
def test_a_frozen_max_norm_embedding_is_refused_by_the_steps(variant):
    """Formerly accepted: the forward renormalised, in the model, exactly the rows of the batch's tokens."""
    torch.manual_seed(0)
    model = _frozen_max_norm()
    before = model[0].weight.clone()
    with pytest.raises(UnsupportedLayerError, match=r"these Embedding layers have max_norm set: .*: 0 \(Embedding\)"):
        make_variant(variant, 4, 40).gradient(model, _batch(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])), 0)
    assert torch.equal(model[0].weight, before)
    fix(model)
    make_variant(variant, 4, 40).gradient(model, _batch(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])), 0)


def test_without_the_refusal_a_frozen_max_norm_embedding_writes_the_batch_into_the_model(monkeypatch):
    """The hole, measured with the predicate and the watch on frozen parameters switched off: after one DP-SGD step
    the frozen embedding's rows differ from the initial ones exactly at the batch's tokens, released with the model,
    unnoised."""
    monkeypatch.setattr(validation, "renorms_embedding_rows", lambda module: False)
    monkeypatch.setattr(validation.BufferWatch, "check", lambda self, what: None)
    torch.manual_seed(0)
    model = _frozen_max_norm()
    before = model[0].weight.clone()
    make_variant("dpsgd", 4, 40).gradient(model, _batch(torch.tensor([[1, 2, 3], [1, 2, 3], [4, 4, 4]])), 0)
    changed = (model[0].weight != before).any(1).nonzero().flatten().tolist()
    assert changed == [1, 2, 3, 4]


# ------------------------------------------------------------------------------ shared refusals and old paths


def test_old_import_paths_still_work():
    from fastdp.nn import (
        UnsupportedLayerError as OldError,
    )
    from fastdp.nn import (
        batch_statistics_layers,
        check_supported,
        mixes_examples,
        refuse_batch_statistics,
    )
    from fastdp.nn.backprop import check_backprop_supported, refuse_reused_layers

    assert OldError is validation.UnsupportedLayerError
    assert check_supported is validation.check_supported and mixes_examples is validation.mixes_examples
    assert batch_statistics_layers is validation.batch_statistics_layers
    assert refuse_batch_statistics is validation.refuse_batch_statistics
    assert check_backprop_supported is validation.check_backprop_supported
    assert refuse_reused_layers is validation.refuse_reused_layers
    assert dpnn.validate is validation.validate and dpnn.fix is validation.fix and dpnn.is_valid is validation.is_valid


@pytest.mark.parametrize("variant", ["dpsgd", "jl", "backprop", "clipless", "weightclip"])
def test_check_parameter_dtypes_gives_the_variants_message(variant):
    """The pure dtype refusal gives Variant.check_parameters' message word for word, so base.py can call it."""
    model = _lipschitz() if variant in ("clipless", "weightclip") else nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model.bfloat16()
    algorithm = make_variant(variant, 4, 40)
    with pytest.raises(ValueError) as expected:
        algorithm.check_parameters(model)
    reason = algorithm.low_precision_refusal or LOW_PRECISION_PARAMETERS_DPSGD
    with pytest.raises(UnsupportedLayerError) as got:
        dpnn.check_parameter_dtypes(model, algorithm.name, reason, autocast=algorithm.low_precision_refusal is None)
    assert str(got.value) == str(expected.value)
    model.float()
    dpnn.check_parameter_dtypes(model, algorithm.name, reason)
    assert validation.low_precision_parameters(model) == []


def test_problem_kinds_are_documented():
    text = open("docs/validate.md").read()
    kinds = ("unsupported-layer", "batch-statistics", "shared-parameter", "low-precision", "padding-mode",
             "padding-same", "embedding-sparse", "embedding-max-norm", "no-lipschitz-rule")  # fmt: skip
    assert all(f"`{kind}`" in text for kind in kinds)
    assert all(f"`{name}`" in text for name in validation.VARIANT_NAMES)
