"""Each row of a batch must be one example: a probe that the shapes cannot fool.

Every per-example bound in fastdp rests on one property: example i's loss, and the input rows that a DP layer clips or
norms per example, depend on example i alone. A comparison of sizes cannot establish it: a layer called on a
``[T, B, d]`` view passes a "first dimension == B" check when T == B (micro-batch size = sequence length), and is then
clipped per position, not per example; a model that mixes examples (a statistic over the batch, a layer applied along
the batch dimension after a transpose) passes any shape check.

The probe establishes it for a batch by experiment: it runs the model's forward on the batch and on the batch with
some examples' inputs replaced by others' (the first example alone, the last alone, then for every bit of the row
index the rows with that bit set and those with it clear: any two examples differ in a bit, so whichever row mixes
into which, one experiment changes it and watches the other: 2 ceil(log2 B) more forwards, once per model and input
structure, whatever the shapes), and, also once per structure, with the first example's floating inputs made extreme
(a mixing too small to see at ordinary values moves the other rows then) and on about the first half of the batch (at
a size not seen inside the model; within ``REMOVAL_TOLERANCE``, as other sizes run other kernels: a model that reads
the batch's size, ``h / h.shape[0]``, changes every other example then, and under Poisson sampling that size is one
example's presence), and requires that nothing
else changes: the per-example losses of the other examples, and the other rows of every watched layer's input. Same
shapes, same kernels, same dropout masks (the generator state is forked and reset for every run), so an unchanged
row is bitwise unchanged; rows are compared through small float64 fingerprints (a random projection, the squared
norm, the non-finite count: no activation is kept), with a tolerance of ``TOLERANCE`` of each row's norm for kernels
that are not bitwise reproducible. With ghost clipping the probe also runs one backward per input (of a squared
per-example functional of the outputs) and requires that the other examples' rows of every DP layer's output
gradient do not change either: a layer on an input shared by the batch (a position index whose length happens to
equal the batch size) has rows that are not examples, though its input rows never change. A batch whose examples are
all the same, or that holds a non-finite entry (NaN rows would hide a change), is probed on random inputs of its
shape instead (for token ids: ids up to the batch's largest); an experiment that stays inconclusive (a batch of one,
or of token id 0 only) says so, proves nothing, and the next batch is probed.

Models whose computation does not depend on the data's values (no data-dependent control flow over the batch) give
the same answer for every batch of the same shape; :class:`RowProbe` therefore probes once per shape signature: the
input's shape without the batch size, the modules' train/eval modes, and, when the batch size equals a size seen
inside the model (where a coincidence of sizes could hide a layout error), the batch size itself.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence
from torch.utils._pytree import tree_flatten, tree_map

from fastdp.nn import UnsupportedLayerError

TOLERANCE = 1e-6
# the removal run's: fewer rows run other kernels (GEMM blockings by size), which re-round every row by ~1e-6 of it;
# halving the batch rescales a model that reads its size by a factor ~2
REMOVAL_TOLERANCE = 1e-2
_PROBE_SEED = 0x5EED


def _fingerprint(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """A small per-row summary of a [B, ...] tensor, whatever its size (the probe keeps no activations): each row's
    float64 projection on a fixed direction w, its squared norm, its count of non-finite entries, and |w|.
    Two rows that differ have different summaries with probability 1."""
    flat = t.detach().reshape(t.shape[0], -1)
    finite = torch.isfinite(flat) if flat.is_floating_point() else torch.ones_like(flat, dtype=torch.bool)
    clean = torch.where(finite, flat, 0).double()
    direction = _direction(clean.shape[1], t.device)
    return clean @ direction, clean.pow(2).sum(1), (~finite).sum(1), float(direction.norm())


def _direction(size: int, device: torch.device) -> torch.Tensor:
    """A fixed float64 direction with incommensurate entries, computed, not drawn (the probe makes no random draw of
    its own)."""
    return torch.sin(torch.arange(1, size + 1, device=device, dtype=torch.float64) * 12.9898 + 78.233)


def row_functional(rows: list[torch.Tensor]) -> torch.Tensor:
    """Half the squared projection of each example's output rows on a fixed direction, summed over the examples: the
    per-example "loss" the front door's probe backpropagates (the user's loss is not known to it). Squared, so that
    example i's output gradient depends on its output (a linear functional's would be constant, and a layer whose
    rows are not examples would go unseen behind a linear head)."""
    total = torch.zeros((), dtype=torch.float64, device=rows[0].device if rows else None)
    for r in rows:
        flat = r.reshape(r.shape[0], -1).double()
        total = total + (flat @ _direction(flat.shape[1], r.device)).square().sum() / 2
    return total


def _rows_differ(before: tuple, after: tuple, keep: torch.Tensor, tolerance: float = TOLERANCE) -> bool:
    """Whether rows ``keep`` of two fingerprints differ by more than ``tolerance`` of each row's norm (kernels that are
    not bitwise reproducible move a row by ~1e-7 of it; an example that leaks into another row, by far more)."""
    (proj, sq, bad, w), (proj_p, sq_p, bad_p, _) = before, after
    if proj.shape != proj_p.shape:
        return True
    norm = sq[keep].sqrt()
    return bool(
        ((proj[keep] - proj_p[keep]).abs() > tolerance * norm * w + 1e-300).any()
        | ((sq[keep] - sq_p[keep]).abs() > 2 * tolerance * sq[keep] + 1e-300).any()
        | (bad[keep] != bad_p[keep]).any()
    )


def _layer_rows(module: nn.Module, value) -> torch.Tensor | None:
    """A watched layer's input or output as the rows it processes, one example per row: the tensor itself; for a
    recurrent layer (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``, whose output is a tuple) the sequence, batch-first as its DP
    layer takes it (``[T, B, ...]`` without ``batch_first`` transposed, a PackedSequence padded); for an
    ``nn.MultiheadAttention`` (output ``(output, weights)``) its query or output, transposed when it is sequence-first
    (``batch_first=False``, 3-D: its DP layer transposes it, ``fastdp.nn.attention``); None for anything else."""
    if isinstance(module, nn.RNNBase):
        value = value[0] if isinstance(value, tuple) and not isinstance(value, PackedSequence) else value
        if isinstance(value, PackedSequence):
            return pad_packed_sequence(value, batch_first=True)[0]
        if isinstance(value, torch.Tensor) and value.dim() == 3 and not module.batch_first:
            return value.transpose(0, 1)
    if isinstance(module, nn.MultiheadAttention):
        value = value[0] if isinstance(value, tuple) and value else value
        if isinstance(value, torch.Tensor) and value.dim() == 3 and not module.batch_first:
            return value.transpose(0, 1)
    return value if isinstance(value, torch.Tensor) else None


def _rows_of(x, batch: int) -> list[torch.Tensor]:
    """The batch-first tensors of an input structure (a tensor, or tuples, lists and dicts of them, e.g. a forward's
    ``(args, kwargs)``): every tensor leaf whose first dimension is the batch."""
    leaves, _ = tree_flatten(x)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch]


def _map_rows(fn, x, batch: int):
    """``x`` with ``fn`` applied to each of its batch-first tensors (the other leaves kept)."""
    return tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch else t, x)


def _picks(x, batch: int, halves: bool = True) -> list[tuple[list[int], list[int]]]:
    """[(rows, sources)]: the inputs of the examples ``rows`` are replaced by those of ``sources`` (one each), and
    every other row must stay as it was. First two single experiments, k the first and the last example (a model
    that routes every example's gradient through one row, ``pos[0]`` of a shared lookup expanded to the batch,
    changes only row k when example k is the one replaced), each from the example that differs from k in the most
    batch-first tensors (a model that mixes examples through one argument, a mask's mean over the batch, shows it
    only when that argument changes); then, for every bit of the row index, the rows with that bit set and those
    with it clear, each replaced by rows of the other half: any two examples i != j differ in a bit, so some
    experiment changes i and watches j, whichever row mixes into which (a statistic held by a middle example, a row
    every example reads); 2 ceil(log2 B) experiments, with ``halves`` (once per model and input structure: see
    :class:`RowProbe`). Empty if all examples are equal."""
    flats = [t.reshape(batch, -1) for t in _rows_of(x, batch)]
    picks = []
    for k in (0, batch - 1):
        differing = [sum(not torch.equal(flat[k], flat[m]) for flat in flats) if m != k else 0 for m in range(batch)]
        best = max(differing)
        if best:
            picks.append(([k], [differing.index(best)]))
    if not picks or not halves:
        return picks
    for bit in range((batch - 1).bit_length()):
        high = [i for i in range(batch) if i >> bit & 1]
        low = [i for i in range(batch) if not i >> bit & 1]
        for rows, others in ((high, low), (low, high)):
            picks.append((rows, [others[j % len(others)] for j in range(len(rows))]))
    return picks


def _extreme_first(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its first row's entries scaled so that the largest is ``finfo.max ** 0.75`` (zero and non-finite
    entries taken as 1); integer tensors as they are."""
    if not t.is_floating_point():
        return t
    t = t.clone()
    row = t[0]
    row = torch.where(torch.isfinite(row) & (row != 0), row, torch.ones_like(row)).double()
    t[0] = (row / row.abs().amax() * torch.finfo(t.dtype).max ** 0.75).to(t.dtype)
    return t


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``t``'s shape and dtype (and value range, for integers: token ids and masks up to the largest;
    negative entries, e.g. labels -100 that a loss ignores, kept where they are)."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=gen, device=t.device).bool()
    high = int(t.max()) + 1 if t.numel() else 1
    drawn = torch.randint(0, max(high, 1), t.shape, generator=gen, device=t.device, dtype=t.dtype)
    return torch.where(t < 0, t, drawn)


def input_signature(x, batch: int, shapes: bool = True) -> tuple:
    """The shapes (without the batch size), dtypes and devices of an input structure's tensors, and its layout;
    without ``shapes``, each tensor's rank and whether it is batch-first instead of its shape (the structure)."""
    leaves, spec = tree_flatten(x)

    def leaf(t) -> tuple | str:
        if not isinstance(t, torch.Tensor):
            return type(t).__name__
        own = bool(t.dim()) and t.shape[0] == batch
        if not shapes:
            return t.dim(), own, t.dtype, t.device.type
        return tuple(t.shape[1:]) if own else ("shared", tuple(t.shape)), t.dtype, t.device.type

    return str(spec), tuple(leaf(t) for t in leaves)


@contextlib.contextmanager
def _same_randomness(device: torch.device):
    """Fork the generators (the step's own randomness is untouched) and seed them identically for each run."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        yield


def probe_rows(
    run,
    model: nn.Module,
    x,
    layers: list[nn.Module],
    what: str,
    batch: int | None = None,
    gradients=None,
    halves: bool = True,
) -> set[int] | None:
    """Run ``run(x, size)`` (per-example losses or outputs, [size, ...], of ``x``'s ``size`` examples) on ``x``, on
    ``x`` with one example's input replaced and on ``x`` without its last examples, watching the inputs of ``layers``;
    raise :class:`UnsupportedLayerError` if another example's loss or another row of a watched layer's input changed.
    ``gradients(x, size)`` (ghost clipping): the output gradients G of the
    DP layers' calls, in call order, for one backward of the summed per-example losses; another example's row of a
    G must not change either (a layer whose input does not come from the batch, e.g. a position index shared by the
    examples whose length equals the batch size, has rows that are positions: each row of its G sums every
    example). ``x`` is a batch-first tensor, or any structure of them (tuples, lists, dicts: a forward's
    ``(args, kwargs)``, with ``batch`` its number of examples): the example's row is
    replaced in every batch-first tensor. Returns the sizes seen inside the model (every non-leading dimension of the
    watched inputs and outputs), or None if the probe was inconclusive (fewer than two distinct examples)."""
    batch = x.shape[0] if batch is None else batch
    rows = _rows_of(x, batch)
    if batch < 2 or not rows:
        return None
    device = rows[0].device
    finite = all(bool(torch.isfinite(t).all()) for t in rows if t.is_floating_point())
    experiments = []
    picks = _picks(x, batch, halves)
    if picks:  # the batch itself, non-finite entries included (a model may mix examples only where one is NaN)
        experiments.append((x, picks))
    if not picks or not finite:  # every example the same, or a non-finite one (NaN rows would hide a change): also
        # random inputs of the batch's shape (and value range)
        gen = torch.Generator(device=device).manual_seed(_PROBE_SEED)
        random = _map_rows(lambda t: _random_like(t, gen), x, batch)
        picks = _picks(random, batch, halves)
        if picks:
            experiments.append((random, picks))
    if not experiments:
        return None
    sizes: set[int] = set()
    for inputs, picks in experiments:
        seen = _experiments(run, model, inputs, picks, layers, what, batch, gradients, device, halves)
        if seen is None:
            return None
        sizes |= seen
    return sizes


def _experiments(run, model: nn.Module, x, picks: list, layers: list[nn.Module], what: str, batch: int, gradients,
                 device: torch.device, whole: bool = True) -> set[int] | None:  # fmt: skip
    """:func:`probe_rows`' experiments on ``x``: the run on ``x`` and one for each pick, and with ``whole`` (once per
    model and input structure, as the halves) one with an extreme first example and one on about half the batch,
    compared; the sizes seen (None: no size to remove to, inconclusive)."""

    def replaced(rows: list[int], sources: list[int]):
        def replace(t: torch.Tensor) -> torch.Tensor:
            t = t.clone()
            t[rows] = t[sources]
            return t

        return replace

    names = {id(module): name or "<model>" for name, module in model.named_modules()}

    def one_run(inputs, size: int, like: tuple | None = None, seed: int = _PROBE_SEED) -> tuple:
        """The losses, the watched inputs' and the G's summaries of a run on ``size`` examples; a tensor is batch-first
        when its first dimension is ``size`` and, given ``like`` (the batch's run), it was batch-first there too (a
        shared index of the batch's size less one is not an example's)."""
        seen: list[tuple[nn.Module, torch.Size, tuple, torch.Size]] = []  # layer, input shape and fingerprint, output

        def record(module, args, output):
            a, out = _layer_rows(module, args[0] if args else None), _layer_rows(module, output)
            if a is not None and out is not None:
                was = like is None or (len(seen) < len(like[1]) and like[1][len(seen)][2][0])
                own = bool(a.dim()) and a.shape[0] == size and was
                # an input not batch-first (an index shared by the examples) is compared whole: it must not change
                summary = (own, _fingerprint(a if own else a.reshape(1, -1)))
                seen.append((module, a.shape, summary, out.shape))

        handles = [layer.register_forward_hook(record) for layer in layers]
        try:
            with _same_randomness(device):
                torch.manual_seed(seed)
                losses = run(inputs, size).detach()
        finally:
            for handle in handles:
                handle.remove()
        grads = None
        if gradients is not None:
            with _same_randomness(device):
                torch.manual_seed(seed)
                found = gradients(inputs, size)
            batch_first = [bool(g.dim()) and g.shape[0] == size
                           and (like is None or (i < len(like[2] or ()) and like[2][i][2] is not None))
                           for i, (_, g) in enumerate(found)]  # fmt: skip
            grads = [(layer, g.shape, _fingerprint(g) if own else None)
                     for (layer, g), own in zip(found, batch_first, strict=True)]  # fmt: skip
        return losses, seen, grads

    runs = [one_run(inputs, batch) for inputs in (x, *(_map_rows(replaced(rows, sources), x, batch)
                                                        for rows, sources in picks))]  # fmt: skip
    for (rows, _), perturbed in zip(picks, runs[1:], strict=True):
        _compare(runs[0], perturbed, rows, batch, names, what)
    sizes = set()
    for _, shape, _, out in runs[0][1]:
        sizes.update(shape[1:])
        sizes.update(out[1:])
    if not whole:
        return sizes
    # the first example's floating inputs made extreme: mixing too small to change another row at ordinary values
    # (h + 1e-12 h.sum(0), a tolerance's worth) moves it then, as a later batch's extreme example would (a review:
    # 85 C at n = 64, the probe having passed on an ordinary first batch)
    if any(t.is_floating_point() for t in _rows_of(x, batch)):
        try:  # a model may refuse such values (an index computed from an input): then this run proves nothing
            extreme = one_run(_map_rows(_extreme_first, x, batch), batch)
        except Exception:
            extreme = None
        if extreme is not None:
            _compare(runs[0], extreme, [0], batch, names, what)
    # the batch without its last examples: the others' rows must not change either (a model that reads the batch's
    # size, ``h / h.shape[0]``, rescales every example when one is removed, and no replacement shows it). About half
    # kept (a size dependence shows at ~2x, far above the other kernels' rounding), at a size not seen inside the
    # model (where a shared index could pass for the examples' rows)
    kept = next((k for k in range(batch // 2, 0, -1) if k not in sizes), None)
    if kept is None:
        return None  # no size to remove to: inconclusive, the next batch is probed
    fewer = _map_rows(lambda t: t[:kept], x, batch)

    def removal(reference: tuple) -> list[str]:
        try:
            without = one_run(fewer, kept, like=reference)
        except Exception as exc:
            raise UnsupportedLayerError(
                f"{what} probes each example's independence on the batch without its last examples, and the model "
                f"failed on it ({type(exc).__name__}: {exc}): Poisson batches vary in size, so the model must run on "
                "any number of examples (an input shared by the batch whose length equals the batch size is sliced "
                "with the examples: expand shared indices to [B, ...])"
            ) from exc
        return _differences(_first_rows(reference, kept), without, [], kept, names, REMOVAL_TOLERANCE)

    def random(reference: tuple) -> bool:  # whether another seed changes the run: the model draws random numbers
        return bool(_differences(reference, one_run(x, batch, seed=_PROBE_SEED + 1), [], batch, names))

    mixed = removal(runs[0])
    if mixed and random(runs[0]):
        # where each random draw (dropout) lands in the generator's stream depends on the batch's size, whatever the
        # model computes: again with the dropout layers and rates at 0, or, if it draws elsewhere too, in eval mode
        with _without_dropout(model):
            reference = one_run(x, batch)
            drawing = random(reference)
            if not drawing:
                mixed = removal(reference)
        if drawing:
            with _evaluating(model):
                mixed = removal(one_run(x, batch))
    if mixed:
        raise UnsupportedLayerError(
            f"{what} needs each example's computation to depend on that example alone, but removing the batch's last "
            "examples changed the other examples' rows of: " + "; ".join(mixed) + ". The model (or "
            "its loss) reads the batch's size or another batch-wide quantity (h / h.shape[0], a mean or a count over "
            "the batch): Poisson sampling changes that size with every example, so one example would rescale every "
            "other example's gradient. Compute each example's output from its own input alone"
        )
    return sizes


def _first_rows(run: tuple, k: int) -> tuple:
    """A probe run's summaries of its first ``k`` examples only (to compare with a run on those examples alone)."""

    def head(summary: tuple) -> tuple:
        *rows, w = summary
        return (*(r[:k] for r in rows), w)

    losses, seen, grads = run
    seen = [(layer, shape, (own, head(fp) if own else fp), out) for layer, shape, (own, fp), out in seen]
    grads = None if grads is None else [(layer, shape, fp if fp is None else head(fp)) for layer, shape, fp in grads]
    return losses[:k], seen, grads


def _differences(run, perturbed, rows: list[int], batch: int, names: dict, tolerance: float = TOLERANCE) -> list[str]:
    """What changed, outside ``rows``, between two probe runs on ``batch`` examples."""
    (losses, seen, grads), (losses_p, seen_p, grads_p) = run, perturbed
    keep = torch.ones(batch, dtype=torch.bool, device=losses.device)
    keep[rows] = False
    mixed = []
    if _rows_differ(
        _fingerprint(losses.reshape(batch, -1)), _fingerprint(losses_p.reshape(batch, -1)), keep, tolerance
    ):
        mixed.append("the per-example losses (the loss or the model mixes examples)")
    whole = torch.ones(1, dtype=torch.bool, device=losses.device)
    for (layer, shape, (own, summary), _), (_, _, (own_p, summary_p), _) in zip(seen, seen_p, strict=False):
        if own != own_p or _rows_differ(summary, summary_p, keep if own else whole, tolerance):
            mixed.append(f"{names.get(id(layer), '?')} ({type(layer).__name__}), input of shape {tuple(shape)}")
    if len(seen) != len(seen_p) or (grads is not None and len(grads) != len(grads_p)):
        mixed.append("the layers called (the model's control flow depends on the data)")
    for (layer, shape, summary), (_, _, summary_p) in zip(grads or [], grads_p or [], strict=False):
        if summary is None or summary_p is None or _rows_differ(summary, summary_p, keep, tolerance):
            mixed.append(f"{names.get(id(layer), '?')} ({type(layer).__name__}), output gradient of shape "
                         f"{tuple(shape)} (its rows are not the examples: an input shared by the batch?)")  # fmt: skip
    return list(dict.fromkeys(mixed))


def _compare(run, perturbed, rows: list[int], batch: int, names: dict, what: str) -> None:
    """Raise :class:`UnsupportedLayerError` naming what changed, outside ``rows``, between two probe runs."""
    mixed = _differences(run, perturbed, rows, batch, names)
    if mixed:
        raise UnsupportedLayerError(
            f"{what} needs each row of the batch to be one example, but changing {_examples(rows)} alone changed "
            "other rows of: " + "; ".join(mixed) + ". A layer called on a sequence-first [T, B, ...] "
            "view (e.g. an RNN or nn.MultiheadAttention given batch-first data without batch_first=True, or a "
            "transpose before a Linear) is applied per position, not per example, and an operation over the batch "
            "dimension (batch statistics, a layer applied along it) makes one example change the others, and a "
            "layer called on an input shared by the batch (a [T] position index broadcast over the examples) has "
            "rows that are not examples: keep inputs batch-first (expand shared indices to [B, T]) and every "
            "example's computation its own"
        )


@contextlib.contextmanager
def _without_dropout(model: nn.Module):
    """torch's dropout layers at p = 0, and every module's float attribute named like a dropout rate (``nn.RNN``'s,
    ``nn.MultiheadAttention``'s, Hugging Face attention's ``dropout_prob``/``attention_dropout``), restored after."""
    saved = []
    for module in model.modules():
        names = ["p"] if isinstance(module, nn.modules.dropout._DropoutNd) else []
        names += [k for k, v in vars(module).items() if "dropout" in k.lower() and type(v) is float]
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, 0.0)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@contextlib.contextmanager
def _evaluating(model: nn.Module):
    """The model in evaluation mode (no random draws in torch's layers), its modes restored after."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def _examples(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:8])) + (", ..." if len(rows) > 8 else "")
    return f"example {rows[0]}" if len(rows) == 1 else f"examples {shown} ({len(rows)} of them)"


class RowProbe:
    """Runs :func:`probe_rows` once per shape signature of a model's batches (see the module docstring)."""

    def __init__(self) -> None:
        self._inner: dict[tuple, set[int]] = {}  # signature without batch size -> sizes seen inside the model
        self._done: set[tuple] = set()
        # (model, input structure and dtypes, modes, layers): probed with the halves experiments (once: mixing through
        # a row is the model's, whatever the shapes; the per-shape probes keep the first and last example's)
        self._halves: set[tuple] = set()

    def check(
        self,
        run,
        model: nn.Module,
        x,
        layers: list[nn.Module],
        what: str,
        before=None,
        batch: int | None = None,
        gradients=None,
        finite: bool | None = None,
    ) -> None:
        """Probe ``model`` on ``x`` (a batch-first tensor, or a structure of them with ``batch`` examples: see
        :func:`probe_rows`) unless a batch of the same signature was probed; ``before()`` runs first when a probe is
        due (a variant's own checks, whose named refusals say more than the probe's). ``finite`` (whether the batch's
        floating inputs are all finite, where the caller may read it) is part of the signature: a batch with a NaN is
        probed apart (a model may mix examples only to fill in missing values)."""
        batch = x.shape[0] if batch is None else batch
        modes = tuple(m.training for m in model.modules())
        key = (id(model), input_signature(x, batch), modes, tuple(id(layer) for layer in layers), finite)
        inner = self._inner.get(key)
        full = (*key, batch if inner is None or batch in inner else None)
        if full in self._done:
            return
        if before is not None:
            before()
        structure = (key[0], input_signature(x, batch, shapes=False), *key[2:])
        halves = structure not in self._halves
        sizes = probe_rows(run, model, x, layers, what, batch, gradients, halves)
        if sizes is None:
            return  # inconclusive: probe again with the next batch
        self._halves.add(structure)
        self._inner[key] = self._inner.get(key, set()) | sizes
        self._done.add((*key, batch if batch in self._inner[key] else None))
