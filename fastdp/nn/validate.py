"""What fastdp refuses in a model, in one place: :func:`validate` lists every problem at once, :func:`fix` repairs
what can be repaired, and the per-step checks the variants call (:func:`check_supported`,
:func:`check_backprop_supported`, :func:`refuse_reused_layers`, :func:`refuse_batch_statistics`,
:func:`check_parameter_dtypes`) share its predicates.

Like Opacus' ``ModuleValidator``: ``validate(model, variant, strict=False)`` returns the list of problems
(:class:`Problem`: module, type, what is wrong, what to do instead), ``strict=True`` raises one
:class:`UnsupportedLayerError` naming them all, ``is_valid`` is ``not validate(...)`` and ``fix(model, variant)``
replaces BatchNorm by GroupNorm (and makes the few other exact repairs listed in :func:`fix`), in place.

What a model must satisfy depends on the variant (``docs/validate.md``):

* every private variant: no module that mixes examples (:func:`mixes_examples`: BatchNorm with batch statistics,
  InstanceNorm writing running statistics), no Embedding with ``max_norm`` (its forward writes the batch's tokens
  into the model), trainable parameters in float32 or float64;
* ``dpsgd`` (ghost mode) and ``jl``: trainable parameters only in the DP layers of :data:`fastdp.nn.layers.DP_LAYERS`
  (Linear, Conv1d, Conv2d, Embedding, LayerNorm, GroupNorm, RNN, LSTM, GRU, MultiheadAttention; their subclasses that
  keep their forward; HuggingFace's Conv1D: :func:`fastdp.nn.layers.conversion`; a parameter may be shared by several
  layer calls), trainable convolutions with ``padding_mode='zeros'`` and integer padding, trainable embeddings dense;
* ``dpsgd-reference`` (``DPSGD(mode='reference')``): any module torch.func differentiates per example (dense
  embeddings);
* ``backprop``: trainable parameters only in Linear and Conv2d, none shared, convolutions with zero padding;
* ``clipless`` / ``weightclip``: every layer has a Lipschitz bound rule (``fastdp.nn.lipschitz``);
* ``nonprivate``: anything.

What only a step can see (a layer called twice in one forward, inputs that are not batch-first, operations that mix
examples outside any layer, the clipless input bound) stays in the variants' per-step checks.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fastdp.nn.layers import DP_LAYERS, DPLayer, attention_projections, conversion, own_trainable

__all__ = [
    "PARAMETER_DTYPES",
    "BufferWatch",
    "VARIANT_NAMES",
    "Problem",
    "UnsupportedLayerError",
    "batch_statistics_layers",
    "check_backprop_supported",
    "check_parameter_dtypes",
    "check_supported",
    "fix",
    "is_valid",
    "low_precision_parameters",
    "mixes_examples",
    "refuse_batch_statistics",
    "refuse_reused_layers",
    "renorms_embedding_rows",
    "validate",
    "variant_name",
]

# Names validate()/fix() take (a variant object works too: its ``name``, and DPSGD's ``mode``).
VARIANT_NAMES = ("dpsgd", "dpsgd-reference", "jl", "backprop", "clipless", "weightclip", "nonprivate")
# Trainable-parameter dtypes a private variant accepts (fastdp.algorithms.base.Variant.check_parameters).
PARAMETER_DTYPES = (torch.float32, torch.float64)
# Variants with a bf16/fp16 autocast argument (set_precision): the advice for low-precision parameters differs.
AUTOCAST_VARIANTS = ("dpsgd", "nonprivate")

_ALTERNATIVES = {
    "BatchNorm": "GroupNorm (or LayerNorm): batch statistics mix examples, so per-example gradients do not exist",
    "InstanceNorm": "GroupNorm with num_groups = channels and affine=True",
    "RNNCell": "nn.RNN over the whole sequence (a DP layer) instead of a loop of cells",
    "LSTMCell": "nn.LSTM over the whole sequence (a DP layer) instead of a loop of cells",
    "GRUCell": "nn.GRU over the whole sequence (a DP layer) instead of a loop of cells",
    "MultiheadAttention": "nn.MultiheadAttention itself (fastdp.nn.convert makes it a DP layer; not a subclass that "
    "overrides forward), or attention written with nn.Linear projections",
    "NonDynamicallyQuantizableLinear": "nn.MultiheadAttention itself, whose out_proj fastdp.nn.convert makes a DP "
    "Linear it calls (this is the output projection of an attention left unconverted)",
    "ConvTranspose": "nn.Upsample followed by a Conv2d",
    "Conv3d": "Conv2d or Conv1d layers",
    "Bilinear": "Linear layers on the two inputs (or on their concatenation)",
    "PReLU": "a parameter-free activation (ReLU, LeakyReLU, GELU)",
}


class UnsupportedLayerError(ValueError):
    """A model has modules fastdp cannot train privately (per variant); ``problems`` lists them when
    :func:`validate` raised it (``strict=True``)."""

    def __init__(self, message: str, problems: Sequence[Problem] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems)


class BufferWatch:
    """The model's buffers (and the extra state of modules that define ``get_extra_state``: compared by value) as
    they are now, to refuse a private step in which one was written: a buffer written from the batch (running
    statistics, a quantisation observer's min/max, a cache of the inputs) is saved with the model, unnoised.
    :meth:`check` raises :class:`UnsupportedLayerError` naming each buffer replaced, added, removed or written in
    place since the watch began. In-place writes are seen by the tensor's version counter and storage
    (no copy, no device read); with ``values=True`` (a model's first private step, once per model: the row probe's
    rhythm) also by value, which catches writes that bypass the counter (``buf.data.copy_``, NumPy views).

    Buffers fastdp's own layers keep outside the training forward (a certificate computed from the weights: the
    names in a module's ``dp_bookkeeping_buffers``) are not watched."""

    def __init__(self, model: nn.Module, values: bool = False) -> None:
        self._model = model
        self._state = {key: (buf, _version_of(buf), buf.detach().clone() if values and buf is not None else None)
                       for key, buf in _watched_buffers(model).items()}  # fmt: skip
        self._extra = {name: copy.deepcopy(state) for name, state in _extra_states(model).items()}

    def changed(self) -> list[str]:
        """The names of the buffers that changed since the watch began."""
        now = _watched_buffers(self._model)
        names = [name for name in self._state if name not in now]
        for name, buf in now.items():
            if name not in self._state:
                names.append(name)
                continue
            old, version, values = self._state[name]
            if buf is None or old is None:
                if buf is not old:
                    names.append(name)
            elif buf is not old or _version_of(buf) != version:
                names.append(name)
            elif values is not None and not _same_values(buf, values):
                names.append(name)
        extra = _extra_states(self._model)
        names += [
            name
            for name in dict.fromkeys([*self._extra, *extra])
            if name not in extra or name not in self._extra or not _same_state(extra[name], self._extra[name])
        ]
        return names

    def check(self, what: str) -> None:
        changed = self.changed()
        if changed:
            raise UnsupportedLayerError(
                f"{what}: the model wrote its buffers, frozen parameters or extra state {', '.join(changed)} during "
                "the private step. A buffer or frozen parameter written from the batch (running statistics, a "
                "quantisation observer's min/max, a cache of the inputs, an embedding table renormalised by max_norm) "
                "is saved with the model without noise, so it releases the examples it read. Keep such modules out "
                "of the private step (put them in eval() mode, freeze their statistics, or compute them on public "
                "data)"
            )


def _watched_buffers(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """The buffers, and the frozen parameters (``requires_grad=False``: saved with the model like a buffer, and as
    writable from the batch: running statistics kept in a Parameter, ``F.embedding(..., max_norm=)`` renormalising a
    frozen table's looked-up rows in place; a review measured an exact membership signal), by name."""
    watched = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        exempt = getattr(module, "dp_bookkeeping_buffers", ())
        frozen = {name: p for name, p in module._parameters.items() if p is not None and not p.requires_grad}
        for name, buf in [*module._buffers.items(), *frozen.items()]:
            if name not in exempt:
                watched[f"{module_name}.{name}" if module_name else name] = buf
    return watched


def _extra_states(model: nn.Module) -> dict[str, object]:
    """The extra state (``get_extra_state``, saved in the state dict) of every module that defines one."""
    return {f"{name}._extra_state" if name else "_extra_state": module.get_extra_state()
            for name, module in model.named_modules(remove_duplicate=False)
            if type(module).get_extra_state is not nn.Module.get_extra_state}  # fmt: skip


def _same_state(a, b) -> bool:
    """Whether two extra states are equal (tensors by value, containers entry by entry, anything else by ==)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_values(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:  # an object without a usable ==: changed, as far as the watch can tell
        return False


def _version_of(buf: torch.Tensor | None) -> tuple | None:
    if buf is None:
        return None
    try:
        version = buf._version
    except RuntimeError:  # an inference tensor has no version counter (and cannot be written in place outside one)
        version = -1
    return version, buf.data_ptr(), tuple(buf.shape), buf.dtype


def _same_values(buf: torch.Tensor, values: torch.Tensor) -> bool:
    return buf.shape == values.shape and buf.dtype == values.dtype and bool(torch.equal(buf.detach(), values))


@dataclass(frozen=True)
class Problem:
    """One thing a variant refuses in a model: where (``module``, its name in ``model.named_modules()``, "" for
    the model itself; ``module_type``), which ``kind`` of problem, ``what`` is wrong and the ``alternative``; whether
    :func:`fix` repairs it (``fixable``).

    Kinds: "unsupported-layer", "batch-statistics", "shared-parameter", "low-precision", "padding-mode",
    "padding-same", "embedding-sparse", "embedding-max-norm", "no-lipschitz-rule"."""

    module: str
    module_type: str
    kind: str
    what: str
    alternative: str
    fixable: bool = False

    @property
    def name(self) -> str:
        """The module's name as errors print it (``<model>`` for the model itself)."""
        return self.module or "<model>"

    def __str__(self) -> str:
        fixable = " [fastdp.nn.fix repairs this]" if self.fixable else ""
        return f"{self.name} ({self.module_type}): {self.what}. Instead: {self.alternative}{fixable}"


# ---------------------------------------------------------------------------------------------------- predicates


def mixes_examples(module: nn.Module) -> bool:
    """Whether ``module`` makes one example's output, or the model it leaves, depend on the other examples of the
    batch (every variant refuses such a module, trainable or not, in either mode):

    * a BatchNorm (any ``_BatchNorm``, SyncBatchNorm included) in training mode, or in eval mode without running
      statistics (``track_running_stats=False`` or a running_mean/running_var of None): torch then normalises with
      the batch's statistics in eval mode too;
    * an InstanceNorm in training mode with ``track_running_stats=True``: each example is normalised alone, but the
      batch's statistics are averaged into the running statistics (unnoised, released with the model, used in eval
      mode).

    InstanceNorm otherwise normalises each example with its own statistics (or public running ones), in both modes:
    it mixes nothing and is not refused here (a trainable one still needs a DP layer or a rule, per variant)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        running = module.track_running_stats and module.running_mean is not None and module.running_var is not None
        return module.training or not running
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        return module.training and module.track_running_stats
    return False


def renorms_embedding_rows(module: nn.Module) -> bool:
    """Whether ``module`` is an Embedding with ``max_norm``: its forward renormalises, in place, the rows of the
    tokens the batch uses whose norm exceeds max_norm (trainable or frozen, in either mode), so the model it leaves
    shows, unnoised, which tokens the batch held. Every private variant refuses it."""
    return isinstance(module, nn.Embedding) and module.max_norm is not None


def _dp_convertible(module: nn.Module) -> bool:
    """Whether DP-SGD (ghost) and JL clip ``module``'s parameters: a DP layer, or a layer ``convert`` swaps (a
    supported torch layer, a subclass of one not overriding its forward, HF's Conv1D: :func:`conversion`)."""
    return isinstance(module, DPLayer) or conversion(module)[0] is not None


def _backprop_layer(module: nn.Module) -> bool:
    """Whether backprop clipping bounds ``module``'s parameters: an ``nn.Linear``/``nn.Conv2d`` (swapped by
    ``convert_backprop``, exact types) or a layer it swapped."""
    from fastdp.nn.backprop import _SWAP, _BackpropClip  # here: fastdp.nn.backprop imports this module

    return isinstance(module, _BackpropClip) or type(module) in _SWAP


def _display(name: str) -> str:
    return name or "<model>"


def _hint(kind: str) -> str | None:
    return next((text for key, text in _ALTERNATIVES.items() if key in kind), None)


def _same_padding(conv: nn.Module) -> tuple[int, ...] | None:
    """The integer padding equal to ``padding='same'`` for ``conv`` (stride 1), or None where torch pads one side
    more than the other (an even dilation * (kernel - 1))."""
    total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
    return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)


# ------------------------------------------------------------------------------------------ per-step refusals


def check_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` for modules one-backward clipping cannot handle: trainable modules that
    are not DP layers (with the reason where a subclass of a supported layer is not converted,
    :func:`~fastdp.nn.layers.conversion`), layers that mix examples (:func:`mixes_examples`, trainable or not), and
    Embeddings with ``max_norm`` (:func:`renorms_embedding_rows`). One error names every such module, all kinds
    together. Tied weights and layers called more than once are accepted: their per-example gradient sums the uses
    (``fastdp.nn.forms``).

    One walk over the modules (DP-SGD calls it every step: train/eval mode and ``requires_grad`` can change)."""
    bad, mixing, renorming = [], [], []
    for name, module in model.named_modules():
        if renorms_embedding_rows(module):
            renorming.append(f"{_display(name)} ({type(module).__name__})")
        trainable = own_trainable(module)
        if not isinstance(module, DPLayer):
            if trainable:
                bad.append((name, module))
            if mixes_examples(module):
                mixing.append(f"{_display(name)} ({type(module).__name__})")
    messages = []
    if bad:
        lines = []
        for name, module in bad:
            kind = type(module).__name__
            _, why = conversion(module)
            hint = _hint(kind)
            lines.append(f"  {_display(name)} ({kind})" + (f": {why}" if why else f": use {hint}" if hint else ""))
        supported = ", ".join(sorted(t.__name__ for t in DP_LAYERS))
        messages.append(
            "these modules have trainable parameters that DP-SGD's one-backward clipping cannot handle:\n"
            + "\n".join(lines)
            + f"\nSupported layers: {supported}, their subclasses that keep their forward, and HuggingFace's Conv1D "
            "(converted by fastdp.nn.convert). Freeze the others (requires_grad=False), replace them, or use "
            "DPSGD(mode='reference') for arbitrary modules."
        )
    for refuse, layers in ((refuse_batch_statistics, mixing), (refuse_renormed_embeddings, renorming)):
        try:
            refuse(layers)
        except UnsupportedLayerError as error:
            messages.append(str(error))
    if messages:
        raise UnsupportedLayerError("\n".join(messages))


def refuse_batch_statistics(layers: list[str], why: str = "") -> None:
    """Raise :class:`UnsupportedLayerError` naming ``layers`` (from :func:`batch_statistics_layers`) if any;
    ``why`` opens the message with what the caller needs that they break."""
    if layers:
        raise UnsupportedLayerError(
            why + "these layers use batch statistics in training mode, or in eval mode without running statistics "
            "(BatchNorm with track_running_stats=False), so one example changes the other examples' outputs and "
            "gradients (InstanceNorm with track_running_stats=True in training mode: the running statistics it "
            "writes into the model): " + ", ".join(layers) + ". Use GroupNorm or LayerNorm, or put them in eval mode "
            "with running statistics (track_running_stats=True) estimated from public data."
        )


def refuse_renormed_embeddings(layers: list[str], why: str = "") -> None:
    """Raise :class:`UnsupportedLayerError` naming ``layers`` (Embeddings with ``max_norm``,
    :func:`renorms_embedding_rows`) if any; ``why`` opens the message."""
    if layers:
        raise UnsupportedLayerError(
            why + "these Embedding layers have max_norm set: their forward renormalises, in place, the rows of the "
            "tokens the batch uses (trainable or frozen, in either mode), so the model they leave shows which tokens "
            "the batch held, unnoised: " + ", ".join(layers) + ". Set max_norm=None: renormalise every row once "
            "before training (fastdp.nn.fix does this for a frozen embedding) or after each optimizer step "
            "(post-processing of the released weights)."
        )


def batch_statistics_layers(model: nn.Module) -> list[str]:
    """'name (Type)' of every layer of ``model`` that mixes examples (:func:`mixes_examples`: BatchNorm in training
    mode or without running statistics, InstanceNorm updating running statistics): one example then changes the
    others' outputs (or the model), so no per-example bound holds, whether the layer trains or not. The one list
    every variant refuses (DP-SGD ghost and reference, backprop clipping, JL; clipless/weightclip have no Lipschitz
    rule for these layers)."""
    return [f"{_display(name)} ({type(m).__name__})" for name, m in model.named_modules() if mixes_examples(m)]


def check_backprop_supported(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` naming every module that breaks the per-example bounds of a
    model converted by ``fastdp.nn.backprop.convert_backprop``: trainable modules that are not backprop-clip layers
    (nothing clips their gradient), a trainable parameter shared by two of them, layers with batch statistics
    (one example changes the others' activations and gradients, so clipping each example's input and upstream
    gradient bounds nothing) and Embeddings with ``max_norm``. A walk over the modules; BackpropClip calls it every
    step (train/eval mode and ``requires_grad`` can change after the conversion)."""
    from fastdp.nn.backprop import _BackpropClip  # here: fastdp.nn.backprop imports this module

    bad = [
        f"{_display(name)} ({type(m).__name__})"
        for name, m in model.named_modules()
        if not isinstance(m, _BackpropClip) and any(p.requires_grad for p in m.parameters(recurse=False))
    ]
    if bad:
        raise UnsupportedLayerError(
            "backprop clipping supports trainable Linear and Conv2d layers only; freeze or replace: " + ", ".join(bad)
        )
    patched = [f"{_display(name)} ({type(m).__name__})" for name, m in model.named_modules()
               if isinstance(m, _BackpropClip) and "forward" in vars(m)]  # fmt: skip
    if patched:
        raise UnsupportedLayerError(
            "backprop clipping bounds what a layer's own forward computes, but these layers have a forward set on the "
            "instance (a wrapper or a patch, e.g. layer.forward = ...), which need not clip: "
            + ", ".join(patched)
            + ". Remove the patch, or wrap the layer in a module of its own"
        )
    computed = []  # trainable parameters of a layer besides its weight and bias: a weight computed from them
    for name, m in model.named_modules():
        if not isinstance(m, _BackpropClip):
            continue
        extra = [
            n for n, p in m._parameters.items() if p is not None and p.requires_grad and n not in ("weight", "bias")
        ]
        if extra:
            computed.append(f"{_display(name)} ({type(m).__name__}: {', '.join(extra)})")
    if computed:
        raise UnsupportedLayerError(
            "backprop clipping bounds a layer's weight and bias, but these layers compute their weight from other "
            "parameters (the old-style torch.nn.utils.weight_norm or spectral_norm): " + ", ".join(computed) + ". "
            "Remove the reparametrisation (torch.nn.utils.remove_weight_norm) or freeze those parameters"
        )
    owners: dict[int, str] = {}
    for name, m in model.named_modules():
        if not isinstance(m, _BackpropClip):
            continue
        for p in m.parameters(recurse=False):
            if not p.requires_grad:
                continue
            if id(p) in owners:
                raise UnsupportedLayerError(
                    f"a trainable parameter is shared by {owners[id(p)]} and {_display(name)} (tied weights): "
                    "backprop clipping credits it with one layer's per-example bound (C1 C2), but its gradient sums "
                    "both layers' clipped terms (up to 2 C1 C2). Untie the weights (one Parameter per layer), freeze "
                    "them, or use DPSGD(mode='reference')"
                )
            owners[id(p)] = _display(name)
    refuse_batch_statistics(
        batch_statistics_layers(model), "backprop clipping bounds each example's own input and upstream gradient, but "
    )
    refuse_renormed_embeddings(
        [f"{_display(name)} ({type(m).__name__})" for name, m in model.named_modules() if renorms_embedding_rows(m)]
    )


def refuse_reused_layers(model: nn.Module) -> None:
    """Raise :class:`UnsupportedLayerError` naming every backprop-clip layer with trainable parameters that
    was called more than once since ``fastdp.nn.backprop.reset_calls`` (after a step's forward): its weight gradient
    sums k clipped terms g_j x_j^T, up to k C1 C2, while its sensitivity credits one. Frozen layers may be reused
    (no bound is credited to them; the other layers clip their own inputs and upstream gradients)."""
    from fastdp.nn.backprop import _BackpropClip  # here: fastdp.nn.backprop imports this module

    reused = [f"{_display(name)} ({type(m).__name__}, {m.calls} calls)" for name, m in model.named_modules()
              if isinstance(m, _BackpropClip) and m.calls > 1
              and any(p.requires_grad for p in m.parameters(recurse=False))]  # fmt: skip
    if reused:
        raise UnsupportedLayerError(
            "backprop clipping credits each layer's parameters with one per-example bound (C1 C2), but these layers "
            "were called more than once in one forward, so their gradient sums the calls' clipped terms (up to k C1 "
            "C2 for k calls): " + ", ".join(reused) + ". Use a separate layer (its own Parameters) for each call, "
            "freeze them, or use DPSGD(mode='reference')"
        )


def low_precision_parameters(model: nn.Module) -> list[tuple[str, torch.dtype]]:
    """(name, dtype) of every trainable parameter of ``model`` that is not float32/float64 (:data:`PARAMETER_DTYPES`),
    in ``named_parameters()`` order. Frozen ones are not listed: no gradient sum is formed for them."""
    return [(name, p.dtype) for name, p in model.named_parameters()
            if p.requires_grad and p.dtype not in PARAMETER_DTYPES]  # fmt: skip


def check_parameter_dtypes(model: nn.Module, variant: str, why: str, autocast: bool = False) -> None:
    """Refuse trainable parameters that are not float32/float64 (``model.half()``, ``model.bfloat16()``) for the
    private variant named ``variant``, naming them (the first 8): with bf16/fp16 parameters the model's forward and
    backward run in that dtype, and each weight gradient is one low-precision matmul over the batch, rounded after
    the examples are summed. ``why`` is the variant's reason its bound does not survive that (its
    ``low_precision_refusal``, or DP-SGD's ``LOW_PRECISION_PARAMETERS_DPSGD``); ``autocast``: the variant has a
    bf16/fp16 autocast argument (``set_precision``), which the advice then points to. Raises
    :class:`UnsupportedLayerError` (a ValueError); the message is ``Variant.check_parameters``'."""
    bad = low_precision_parameters(model)
    if not bad:
        return
    shown = ", ".join(f"{name} ({str(dtype).removeprefix('torch.')})" for name, dtype in bad[:8])
    more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
    advice = (
        "use set_precision('bf16') (CLI --precision bf16) for mixed precision: autocast of the forward only"
        if autocast
        else f"variant {variant!r} trains in fp32 only (bf16/fp16 autocast, set_precision / --precision, is "
        "available for dpsgd)"
    )
    raise UnsupportedLayerError(
        f"variant {variant!r} trains float32 or float64 parameters only, but these trainable parameters are in "
        f"low precision: {shown}{more}. With bf16/fp16 parameters the model's forward and backward run in that "
        f"dtype: {why}. Keep the trainable parameters in float32 (do not cast the model with .half(), "
        f".bfloat16() or .to(torch.bfloat16)); {advice}"
    )


# ------------------------------------------------------------------------------------------------ validate()


def variant_name(variant) -> str:
    """The name :func:`validate` and :func:`fix` use for ``variant``: one of :data:`VARIANT_NAMES`, or a variant
    object (its ``name``; ``DPSGD(mode='reference')`` is "dpsgd-reference")."""
    name = variant if isinstance(variant, str) else getattr(variant, "name", None)
    if name == "dpsgd" and getattr(variant, "mode", "ghost") == "reference":
        name = "dpsgd-reference"
    if name not in VARIANT_NAMES:
        raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANT_NAMES)} (or pass a variant)")
    return name


_REFERENCE = "DPSGD(mode='reference'), which takes any module's per-example gradients with torch.func"


def _batch_statistics_problem(name: str, module: nn.Module) -> Problem:
    kind = type(module).__name__
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        what = (
            "uses the batch's statistics (training mode, or eval mode without running statistics): one example "
            "changes the other examples' outputs and gradients"
        )
        alternative = (
            "GroupNorm (fastdp.nn.fix replaces it, keeping its affine weight and bias), or LayerNorm; or freeze it "
            "and keep it in eval mode with running statistics estimated from public data"
        )
    else:
        what = (
            "writes the batch's statistics into its running statistics in training mode (unnoised, released with "
            "the model)"
        )
        alternative = "track_running_stats=False (fastdp.nn.fix turns it off: each example is normalised alone)"
    return Problem(name, kind, "batch-statistics", what, alternative, fixable=True)


def _max_norm_problem(name: str, module: nn.Module) -> Problem:
    frozen = not own_trainable(module)
    return Problem(
        name, type(module).__name__, "embedding-max-norm",
        f"max_norm={module.max_norm:g}: its forward renormalises, in place, the rows of the tokens the batch uses "
        "(trainable or frozen), so the model it leaves shows which tokens the batch held, unnoised",
        "max_norm=None; renormalise every row once before training (fastdp.nn.fix does this for a frozen "
        "embedding: the same outputs) or after each optimizer step (post-processing)",
        fixable=frozen,
    )  # fmt: skip


def _unsupported_problem(name: str, module: nn.Module, variant: str) -> Problem:
    kind = type(module).__name__
    norm = isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm))
    params = ", ".join(n for n, p in module._parameters.items() if p is not None and p.requires_grad)
    if variant == "backprop":
        what = f"trainable parameters ({params}) in a layer backprop clipping cannot bound (Linear and Conv2d only)"
        alternative = "freeze it (requires_grad_(False)), replace it, or use variant 'dpsgd'"
        return Problem(name, kind, "unsupported-layer", what, alternative)
    what = f"trainable parameters ({params}) in a module that is not a DP layer, so no per-example norm covers them"
    _, why = conversion(module)
    if why is not None:
        what += f" ({why})"
    hint = _hint(kind)
    if hint is None and not type(module).__module__.startswith("torch."):  # the user's own module's Parameter
        hint = (
            "move the parameter into a supported layer (an nn.Embedding indexed by position for a learned table, "
            "an nn.Linear for a projection)"
        )
    if hint is None:
        hint = "DP layers (" + ", ".join(sorted(t.__name__ for t in DP_LAYERS)) + ")"
    alternative = f"{hint}; or freeze it (requires_grad_(False))"
    if variant == "dpsgd":
        alternative += f", or use {_REFERENCE}"
    fixable = norm and variant in ("dpsgd", "jl")
    return Problem(name, kind, "unsupported-layer", what, alternative, fixable=fixable)


def _low_precision_problem(name: str, module: nn.Module, variant: str) -> Problem | None:
    bad = [(n, p.dtype) for n, p in module._parameters.items()
           if p is not None and p.requires_grad and p.dtype not in PARAMETER_DTYPES]  # fmt: skip
    if not bad:
        return None
    shown = ", ".join(f"{n} ({str(dtype).removeprefix('torch.')})" for n, dtype in bad)
    what = (
        f"trainable parameters in low precision: {shown}; each weight gradient is then one low-precision matmul "
        "over the batch, rounded after the examples are summed, which can move the sum beyond one example's bound"
    )
    alternative = "keep trainable parameters in float32 (no .half() or .bfloat16())"
    if variant == "dpsgd":
        alternative += "; for mixed precision use set_precision('bf16'): autocast of the forward only"
    else:
        alternative += f"; variant {variant!r} trains in fp32 only"
    return Problem(name, type(module).__name__, "low-precision", what, alternative)


def _layer_problems(name: str, module: nn.Module, variant: str) -> list[Problem]:
    """The problems of ``module`` itself (not its children) for a private ``variant``."""
    problems = []
    kind = type(module).__name__
    trainable = bool(own_trainable(module))
    if mixes_examples(module):
        problems.append(_batch_statistics_problem(name, module))
    if renorms_embedding_rows(module):
        problems.append(_max_norm_problem(name, module))
    if variant in ("dpsgd", "jl"):
        if trainable and not _dp_convertible(module):
            problems.append(_unsupported_problem(name, module, variant))
        elif trainable and isinstance(module, (nn.Conv1d, nn.Conv2d)):
            if module.padding_mode != "zeros":
                problems.append(Problem(
                    name, kind, "padding-mode",
                    f"padding_mode={module.padding_mode!r}: the DP layer's per-example norms are those of zero padding",
                    f"padding_mode='zeros', with the input padded before the layer (F.pad(x, ..., "
                    f"mode={module.padding_mode!r}) and padding=0)",
                ))  # fmt: skip
            if module.padding == "same":
                same = _same_padding(module)
                problems.append(Problem(
                    name, kind, "padding-same", "padding='same' (the DP layer takes integer padding)",
                    f"padding={same}, the same output (fastdp.nn.fix sets it)" if same is not None else
                    "integer padding, with the extra row/column torch adds for an even kernel padded by F.pad before "
                    "the layer", fixable=same is not None,
                ))  # fmt: skip
    if variant in ("dpsgd", "jl", "dpsgd-reference") and trainable and isinstance(module, nn.Embedding):
        if module.sparse:
            problems.append(Problem(
                name, kind, "embedding-sparse", "sparse=True (sparse gradients): not supported in DP training",
                "sparse=False: the same outputs and gradient values, dense (fastdp.nn.fix sets it); the noise makes "
                "every row's update dense anyway", fixable=True,
            ))  # fmt: skip
    if variant == "backprop":
        if trainable and not _backprop_layer(module):
            problems.append(_unsupported_problem(name, module, variant))
        if isinstance(module, nn.Conv2d) and _backprop_layer(module) and module.padding_mode != "zeros":
            problems.append(Problem(
                name, kind, "padding-mode",
                f"padding_mode={module.padding_mode!r}: backprop clipping's l15 bound is for zero padding (a converted "
                "conv refuses any other, trainable or not)",
                f"padding_mode='zeros', with the input padded before the layer (F.pad(x, ..., "
                f"mode={module.padding_mode!r}) and padding=0)",
            ))  # fmt: skip
    low = _low_precision_problem(name, module, variant)
    if low is not None:
        problems.append(low)
    return problems


def _shared_parameter_problems(model: nn.Module) -> list[Problem]:
    """Backprop clipping: a trainable parameter registered in two modules (tied weights), or one module registered at
    two places in the model (so called twice): its gradient sums both uses, each credited with one use's bound. One
    problem per module that repeats a parameter. (DP-SGD and JL norm the sum of the uses: ``fastdp.nn.forms``.)"""
    owners: dict[int, str] = {}
    problems = []
    why = "backprop clipping credits each with one use's bound (C1 C2), but its gradient sums both uses"
    for name, module in model.named_modules(remove_duplicate=False):
        repeated = []
        for pname, p in module._parameters.items():
            if p is None or not p.requires_grad:
                continue
            if id(p) in owners:
                repeated.append(f"{pname} (also {owners[id(p)]})")
            else:
                owners[id(p)] = f"{name}.{pname}" if name else pname
        if repeated:
            problems.append(Problem(
                name, type(module).__name__, "shared-parameter",
                f"trainable parameters used elsewhere too: {', '.join(repeated)} (tied weights, or one layer "
                f"registered twice): {why}",
                "untie the weights (one Parameter per layer), freeze them, or use " + _REFERENCE,
            ))  # fmt: skip
    return problems


def _lipschitz_alternative(kind: str, container: bool) -> str:
    from fastdp.nn.lipschitz import _RULES

    if container:
        return (
            "write the model as an nn.Sequential (and Residual blocks) of layers with bound rules: the bounds walk "
            f"those chains only ({_RULES}); or train with variant 'dpsgd'"
        )
    for keys, text in (
        (("Linear",), "LipschitzLinear (projection 'orthogonal' for clipless, 'clip' for weightclip)"),
        (
            ("Conv2d",),
            "LipschitzConv2d (bias-free, zero padding; clipless) or fastdp.nn.weightclip.WeightClipConv2d (weightclip)",
        ),
        (("Pool",), "L2NormPool2d, fastdp.nn.lipdp.MaxPool2d (stride = kernel) or GlobalL2NormPool2d"),
        (
            ("Norm",),
            "LayerCentering, or fastdp.nn.weightclip.LipschitzGroupNorm ((x - mu) / max(alpha, sigma): "
            "dividing by the variance itself has no Lipschitz bound)",
        ),
        (("Tanh",), "fastdp.nn.weightclip.LipschitzTanh, or GroupSort2"),
        (("Sigmoid",), "fastdp.nn.weightclip.LipschitzSigmoid, or GroupSort2"),
        (("GELU", "SiLU", "ELU", "LeakyReLU", "Softplus", "Mish", "Hardtanh"), "GroupSort2 or ReLU"),
        (("Dropout",), "no dropout (its 1/(1-p) scaling has no rule)"),
        (("Embedding",), "variant 'dpsgd' (no Lipschitz embedding layer)"),
    ):
        if any(key in kind for key in keys):
            return text
    return f"a layer with a bound rule ({_RULES}); or train with variant 'dpsgd'"


def _lipschitz_problems(model: nn.Module) -> list[Problem]:
    """Every layer :func:`fastdp.nn.lipschitz.lipschitz_bounds` would walk without a bound rule (its own check,
    ``_unsupported``, on the model's chain and on the block of every Residual the chain reaches)."""
    from fastdp.nn.lipschitz import _NO_RULE, Residual, _unsupported

    found = _unsupported(model)

    def residual_blocks(module: nn.Module, path: str) -> None:
        if isinstance(module, nn.Sequential):
            for child, layer in module.named_children():
                residual_blocks(layer, f"{path}.{child}" if path else child)
        elif isinstance(module, Residual):
            block = f"{path}.block" if path else "block"
            found.extend(_unsupported(module.block, block))
            residual_blocks(module.block, block)

    residual_blocks(model, "")
    problems = []
    for path, kind, why in found:
        module = model.get_submodule(path)
        container = any(True for _ in module.children()) and not isinstance(module, nn.Sequential)
        what = "no Lipschitz bound rule" if why == _NO_RULE else f"a bound rule that does not cover it (it {why})"
        problems.append(Problem(
            path, kind, "no-lipschitz-rule",
            f"{what}, so clipless/weightclip training cannot bound the per-example gradients",
            _lipschitz_alternative(kind, container),
        ))  # fmt: skip
    return problems


def validate(model: nn.Module, variant="dpsgd", strict: bool = False) -> list[Problem]:
    """Every problem ``variant`` has with ``model`` as it is now (train/eval mode, ``requires_grad``, dtypes), in one
    pass: a list of :class:`Problem` (module, type, what is wrong, the alternative, whether :func:`fix` repairs it),
    empty when the variant's checks of the model's modules pass. ``variant``: a name of :data:`VARIANT_NAMES` or a
    variant object. ``strict=True`` raises one :class:`UnsupportedLayerError` listing them all instead (its
    ``problems`` attribute holds the list).

    Checked in the current mode, as every step checks it: a BatchNorm in eval mode with running statistics is a
    fixed per-channel map and accepted (frozen), but ``model.train()`` makes it use batch statistics again."""
    name = variant_name(variant)
    problems: list[Problem] = []
    if name != "nonprivate":
        order = {id(m): i for i, m in enumerate(model.modules())}
        attention = attention_projections(model) if name in ("dpsgd", "jl") else set()
        for path, module in model.named_modules():
            problems += _layer_problems(path, module, name)
            if id(module) in attention and own_trainable(module) and not isinstance(module, DPLayer):
                problems.append(_unsupported_problem(path, module, name))  # convert() leaves it: never called
        if name == "backprop":
            problems += _shared_parameter_problems(model)
        if name in ("clipless", "weightclip"):
            problems += _lipschitz_problems(model)
        problems.sort(key=lambda p: order.get(id(model.get_submodule(p.module)), -1))
    if strict and problems:
        raise UnsupportedLayerError(_strict_message(problems, name), problems)
    return problems


def _strict_message(problems: list[Problem], variant: str) -> str:
    fixable = sum(p.fixable for p in problems)
    lines = "\n".join(f"  {p}" for p in problems)
    tail = (
        f"\nfastdp.nn.fix(model, {variant!r}) repairs the {fixable} marked [fastdp.nn.fix repairs this]; "
        "fastdp.nn.validate(model) lists what remains."
        if fixable
        else ""
    )
    return f"variant {variant!r} cannot train this model as it is ({len(problems)} problems):\n{lines}{tail}"


def is_valid(model: nn.Module, variant="dpsgd") -> bool:
    """Whether :func:`validate` finds nothing."""
    return not validate(model, variant)


# ----------------------------------------------------------------------------------------------------- fix()

MAX_GROUPS = 32  # GroupNorm groups replacing a BatchNorm2d/3d (Wu and He 2018; Opacus' min(32, C))


def _largest_divisor(channels: int, most: int) -> int:
    return max(g for g in range(1, min(most, channels) + 1) if channels % g == 0)


def _group_norm(name: str, bn: nn.modules.batchnorm._BatchNorm, groups: int | None) -> nn.GroupNorm:
    """A GroupNorm in place of ``bn``: the same channels, eps and affine Parameters (the very objects: an optimizer
    built before keeps them), the same train/eval mode; its running statistics are dropped."""
    channels = bn.num_features
    if groups is None:
        groups = 1 if isinstance(bn, nn.BatchNorm1d) else _largest_divisor(channels, MAX_GROUPS)
    if not (isinstance(groups, int) and groups >= 1 and channels % groups == 0):
        raise ValueError(
            f"fastdp.nn.fix: groups={groups!r} does not divide the {channels} channels of {_display(name)} "
            f"({type(bn).__name__}); give a divisor of every BatchNorm's channels, or groups=None"
        )
    gn = nn.GroupNorm(groups, channels, eps=bn.eps, affine=False)
    if bn.affine:
        gn.affine = True
        gn.weight, gn.bias = bn.weight, bn.bias
    return gn.train(bn.training)


def _instance_norm(module: nn.modules.instancenorm._InstanceNorm, variant: str) -> nn.Module:
    """An InstanceNorm without running statistics: GroupNorm(C, C) (the same per-example, per-channel
    normalisation, a DP layer) where DP-SGD/JL must clip its trainable affine parameters, else the same class with
    ``track_running_stats=False``; affine Parameters kept (the same objects)."""
    channels = module.num_features
    if module.affine and own_trainable(module) and variant in ("dpsgd", "jl"):
        new = nn.GroupNorm(channels, channels, eps=module.eps, affine=False)
        new.affine = True
    else:
        new = type(module)(channels, eps=module.eps, momentum=module.momentum, affine=False, track_running_stats=False)
        new.affine = module.affine
    if module.affine:
        new.weight, new.bias = module.weight, module.bias
    return new.train(module.training)


def _fixed(name: str, module: nn.Module, variant: str, groups: int | None) -> nn.Module:
    """``module`` repaired for ``variant`` (a new module, or ``module`` itself changed in place)."""
    norm = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    if isinstance(module, norm) and isinstance(module, nn.modules.lazy.LazyModuleMixin):
        raise ValueError(
            f"fastdp.nn.fix: {_display(name)} ({type(module).__name__}) is a lazy layer not yet initialised; run one "
            "forward first (it then knows its channels)"
        )
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return _group_norm(name, module, groups)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm):
        if module.track_running_stats or (module.affine and own_trainable(module) and variant in ("dpsgd", "jl")):
            return _instance_norm(module, variant)
        return module
    trainable = bool(own_trainable(module))
    if renorms_embedding_rows(module) and not trainable:
        with torch.no_grad():  # every row once: later renormalisations of these rows change nothing
            rows = torch.arange(module.num_embeddings, device=module.weight.device)
            torch.embedding_renorm_(module.weight, rows, module.max_norm, module.norm_type)
        module.max_norm = None
    if not trainable:
        return module
    if isinstance(module, nn.Embedding) and module.sparse and variant in ("dpsgd", "jl", "dpsgd-reference"):
        module.sparse = False
    if isinstance(module, (nn.Conv1d, nn.Conv2d)) and variant in ("dpsgd", "jl") and module.padding == "same":
        same = _same_padding(module)
        if same is not None and module.padding_mode == "zeros":
            module.padding = same
    return module


def fix(model: nn.Module, variant="dpsgd", groups: int | None = None) -> nn.Module:
    """Repair, in place, what ``variant`` refuses in ``model`` and can be repaired, and return the model (a new
    module only when the model itself is a layer that is replaced). What cannot be repaired stays in
    :func:`validate`'s list. For every private variant:

    * every BatchNorm (1d/2d/3d, SyncBatchNorm), in either mode, becomes ``nn.GroupNorm(G, C, eps)`` with the
      BatchNorm's affine weight and bias (the same Parameter objects: an optimizer built before keeps working; the
      per-channel scale and shift mean what they meant) and its train/eval mode; its running statistics are dropped.
      G = ``groups`` if given, else 1 for BatchNorm1d (which also sees [B, C] inputs, where groups of one feature
      would normalise every value to 0) and the largest divisor of C up to 32 for the others (Opacus' min(32, C)
      wherever that divides C). Training mode makes any BatchNorm use batch statistics, so an eval-mode one is
      replaced too; the outputs of a pretrained BatchNorm change (group statistics instead of running ones);
    * an InstanceNorm with ``track_running_stats=True`` stops tracking them (each example is normalised alone, in
      both modes); for ``dpsgd``/``jl`` a trainable affine InstanceNorm becomes ``GroupNorm(C, C)``, the same
      function, which is a DP layer;
    * a frozen Embedding with ``max_norm``: every row renormalised once, then ``max_norm=None`` (the same outputs);
    * ``dpsgd``/``jl``/``dpsgd-reference``: a trainable sparse Embedding becomes dense (``sparse=False``);
    * ``dpsgd``/``jl``: a trainable conv with ``padding='same'`` gets the equal integer padding (odd kernels).

    Forward hooks on a replaced module are not carried over. ``nonprivate``: nothing to repair."""
    name = variant_name(variant)
    if name == "nonprivate":
        return model
    done: dict[int, nn.Module] = {}
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if id(module) not in done:
            done[id(module)] = _fixed(path, module, name, groups)
        new = done[id(module)]
        if new is module:
            continue
        if not path:
            model = new
            continue
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    return model
