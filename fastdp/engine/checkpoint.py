"""Checkpoints of a front-door run: save its state, resume it in a new process with the same privacy settings.

``save_checkpoint(engine, path, module=..., optimizer=..., data_loader=...)`` writes one ``torch.save`` file of plain
containers (loaded back with ``torch.load(weights_only=True)``: no code runs from the file):

* ``model``: the model's ``state_dict`` (the private module's underlying model, ``private._module``: the same keys as
  your model's, so it also loads into a non-private copy);
* ``optimizer``: ``DPOptimizer.state_dict()``, your optimizer's state (momentum buffers, Adam moments, parameter
  groups) and the number of released steps, the index that keys the next step's noise;
* ``accountant``: the accountant's history, so ``get_epsilon`` of the resumed run counts every step of both parts;
* ``sampler``: the Poisson sampler's state. With ``reproducible_seed`` (NOT FOR RELEASE) that is its generator's
  state, so the resumed run draws the batches the uninterrupted run would have drawn. With OS-entropy sampling (the
  default) there is no state: each batch is drawn afresh from the operating system, before and after the resume,
  which is exactly the independent Poisson sampling the accountant analyses;
* ``noise_keys``: which keys the noise had and the last step they served. Reproducible keys are derived from the
  seed and the step index, and the step index continues on resume, so no key serves two releases. OS-entropy keys
  are drawn fresh for every release and are never written: a checkpoint holds no key material from which a released
  model's noise could be regenerated, and the resumed run's noise is fresh;
* ``settings``: everything the privacy guarantee depends on (the variant and its ``describe()``: noise multiplier,
  clip norm(s), sample rate, expected batch size, JL projections; the data set size N, the accountant's mechanism,
  ``loss_reduction``, ``secure_mode``, the privacy randomness);
* ``extra``: entries of your own (the epoch, a scheduler's ``state_dict()``, ``torch.get_rng_state()`` for dropout),
  plain containers of tensors, numbers and strings; :func:`load_checkpoint` returns them.

``load_checkpoint(engine, path, module=..., optimizer=..., data_loader=...)`` loads them into a new engine made
private with the same settings (a new process: ``make_private`` again, then load) and refuses, before anything is
loaded:

* different privacy settings, naming each one with its value in the checkpoint and here: the engine's epsilon assumes
  one setting for the whole run (its noise truncation bound uses the current noise multiplier for every step, and a
  sample rate means something else for another N), so it would be wrong. To change settings, start a new run with a
  new engine and accountant (and add up the two runs' privacy costs yourself);
* an engine that already released a step (its accountant would count steps the checkpoint also counts, or the
  checkpoint's model would replace a model trained on steps the accountant then forgets);
* a checkpoint of another model (parameter or buffer names, shapes or dtypes, or the trainable parameters differ), of
  another optimizer class, or of a reproducible run without its data loader's sampler state.

The accountant is loaded first: should a later part fail to load, the engine over-counts, never under-counts. Bitwise
equality with an uninterrupted run (``reproducible_seed``) needs the checkpoint taken between steps with
``num_workers=0`` or at an epoch boundary (a loader with workers draws batches ahead), and the global torch RNG
(dropout, augmentation) saved by you in ``extra``.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

import torch
from torch import nn

from fastdp.privacy.sampling import PoissonSampler

FORMAT = "fastdp.engine.checkpoint"
VERSION = 1
# describe() entries that are running state or derived from it, not settings: the examples left out as not finite,
# clipless' last step's bounds (from the weights), backprop's per-tensor multiplier (its tensor count, set by a step)
_STATE_NOT_SETTINGS = ("nonfinite_examples", "gradient_bounds", "noise_multiplier_per_tensor")
# settings added after checkpoints were first written, left out at their default so that those checkpoints still load
_NEWER_SETTING_DEFAULTS = {"project_every": 1}
# state-dict entries added since, which a checkpoint without them loads without (LipschitzLinear's certified snapshot:
# absent, the loaded weights themselves stand in for it)
_NEWER_ENTRIES = ("_certified_weight",)


# ------------------------------------------------------------------------------------------------------ helpers
def _dp_optimizer(engine, optimizer):
    """The engine's DPOptimizer, checked to be ``optimizer``."""
    dp = getattr(engine, "optimizer", None)
    if dp is None:
        raise ValueError("no model was made private with this engine yet: call make_private first (a resumed run: "
                         "make_private with the same settings, then load_checkpoint)")  # fmt: skip
    if optimizer is not dp and optimizer is not getattr(dp, "original_optimizer", None):
        raise ValueError("optimizer is not the one this engine made private: pass the optimizer make_private returned")
    return dp


def _model(dp, module) -> nn.Module:
    """The engine's model (``private._module``), checked to be ``module`` (the private module or the model)."""
    private = dp.module
    if module is not private and module is not private._module:
        raise ValueError("module is not the model this engine made private: pass the module make_private returned")
    return private._module


def _sampler(data_loader, dp) -> PoissonSampler | None:
    if data_loader is None:
        return None
    sampler = getattr(data_loader, "poisson", None)
    if not isinstance(sampler, PoissonSampler):
        raise ValueError(
            f"data_loader is a {type(data_loader).__name__}, not the DPDataLoader make_private returned: pass that "
            "one (its Poisson sampler's state is what the checkpoint holds)"
        )
    rate = getattr(dp.variant, "sample_rate", sampler.sample_rate)
    if sampler.sample_rate != rate:
        raise ValueError(f"data_loader samples with rate {sampler.sample_rate!r}, but this engine's optimizer was "
                         f"made private for rate {rate!r}: pass the loader make_private returned")  # fmt: skip
    return sampler


def _plain(value):
    """``value`` as plain containers of numbers and strings (what ``torch.load(weights_only=True)`` reads back)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def privacy_settings(engine) -> dict:
    """The settings the engine's privacy guarantee depends on (module docstring), as plain values."""
    dp = engine.optimizer
    variant = dp.variant
    described = {k: v for k, v in variant.describe().items() if k not in _STATE_NOT_SETTINGS
                 and not (k in _NEWER_SETTING_DEFAULTS and v == _NEWER_SETTING_DEFAULTS[k])}  # fmt: skip
    settings = {f"variant.{k}" if k != "variant" else "variant": _plain(v) for k, v in described.items()}
    keys = getattr(variant, "keys", None)
    settings.update({
        "num_examples": engine.num_examples,
        "accountant": engine.accountant.mechanism,
        "accounted_projections": _plain(dp.projections),
        "loss_reduction": dp.loss_reduction,
        "secure_mode": bool(engine.secure_mode),
        "noise_seed": None if keys is None or not keys.reproducible else keys.reproducible_seed,
    })  # fmt: skip
    return settings


def _model_signature(model: nn.Module) -> dict:
    return {
        "tensors": {k: [list(t.shape), str(t.dtype)] for k, t in model.state_dict().items()},
        "trainable": [n for n, p in model.named_parameters() if p.requires_grad],
    }


def _check_plain(entries: dict) -> None:
    """Refuse entries ``torch.load(weights_only=True)`` would not read back (objects that need code to rebuild)."""
    buffer = io.BytesIO()
    torch.save(entries, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever weights_only refuses
        raise ValueError(
            "extra must hold plain containers (dict, list, tuple) of tensors, numbers and strings, which load without "
            f"running code from the file (torch.load(weights_only=True)); this does not ({exc}). Store a state_dict() "
            "instead of an object"
        ) from exc


# --------------------------------------------------------------------------------------------------------- save
def save_checkpoint(
    engine,
    path: str | os.PathLike | io.IOBase,
    *,
    module: nn.Module,
    optimizer,
    data_loader=None,
    extra: dict | None = None,
    checkpoint_dict: dict | None = None,
) -> None:
    """Write the run's state to ``path`` (module docstring); atomic for a path (temporary file, then rename).

    ``module``, ``optimizer``, ``data_loader``: what ``make_private`` returned (``data_loader`` is required with
    ``reproducible_seed``: its sampler's state; optional with OS-entropy sampling, which has none). ``extra`` (or
    ``checkpoint_dict``, Opacus' name; both may be given if their keys differ): your own entries, returned by
    :func:`load_checkpoint`. Refused between the physical batches of one logical batch (clipped sums pending)."""
    dp = _dp_optimizer(engine, optimizer)
    model = _model(dp, module)
    sampler = _sampler(data_loader, dp)
    keys = getattr(dp.variant, "keys", None)
    reproducible = keys is not None and keys.reproducible
    if reproducible and sampler is None:
        raise ValueError(
            "this run has reproducible_seed (NOT FOR RELEASE): pass data_loader= (the loader make_private returned) so "
            "the checkpoint holds its sampler's state; a resumed run would otherwise replay the batches from step 0"
        )
    if dp.has_pending_sums:
        raise ValueError(
            "the optimizer holds the clipped sums of skipped (virtual) steps of a logical batch not yet released: save "
            "the checkpoint after the logical batch's step (between BatchMemoryManager's logical batches)"
        )
    entries = {**(checkpoint_dict or {})}
    overlap = sorted(set(entries) & set(extra or {}))
    if overlap:
        raise ValueError(f"extra and checkpoint_dict both hold {', '.join(map(str, overlap))}: give each entry once")
    entries.update(extra or {})
    _check_plain(entries)
    nonfinite = getattr(dp.variant, "nonfinite_examples", None)
    state = {
        "format": FORMAT,
        "version": VERSION,
        "settings": privacy_settings(engine),
        "model_signature": _model_signature(model),
        "model": model.state_dict(),
        "optimizer_class": type(dp.original_optimizer).__name__,
        "optimizer": dp.state_dict(),
        "accountant": engine.accountant.state_dict(),
        "sampler": None if sampler is None else sampler.state_dict(),
        # the mode and the last step served; never an OS-entropy key (each release draws a fresh one)
        "noise_keys": {
            "mode": "reproducible" if reproducible else "os-entropy",
            "last_released": None if keys is None else keys.last_released,
        },
        # what the variant carries across steps (e.g. clipless's steps since the last projection) and the count of
        # examples skipped for non-finite gradients
        "variant_state": {
            **dp.variant.checkpoint_state(),
            **({} if nonfinite is None else {"nonfinite_examples": int(nonfinite)}),
        },
        "extra": entries,
    }
    if hasattr(path, "write"):
        torch.save(state, path)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------- load
def _read(path) -> dict:
    if not hasattr(path, "read") and not Path(path).exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)  # no code from the file
    except Exception as exc:  # noqa: BLE001 - any load failure means a corrupt or foreign file
        raise ValueError(f"checkpoint {path} is corrupt or not a fastdp engine checkpoint ({exc})") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a fastdp engine checkpoint (fastdp.engine.checkpoint.save_checkpoint writes "
                         "them; the trainer's checkpoints are resumed with `fastdp train --resume`)")  # fmt: skip
    if state.get("version") != VERSION:
        raise ValueError(f"checkpoint {path} has version {state.get('version')!r}; this fastdp reads version {VERSION}")
    kinds = {"settings": dict, "model_signature": dict, "model": dict, "optimizer_class": str, "optimizer": dict,
             "accountant": dict, "noise_keys": dict, "variant_state": dict, "extra": dict}  # fmt: skip
    bad = [k for k, kind in kinds.items() if not isinstance(state.get(k), kind)]
    if bad or not (state.get("sampler") is None or isinstance(state["sampler"], dict)):
        raise ValueError(f"checkpoint {path} is corrupt: fields missing or of the wrong type: {', '.join(bad)}")
    return state


def _differences(saved: dict, current: dict) -> list[str]:
    def shown(d: dict, k: str) -> str:
        return repr(d[k]) if k in d else "(absent)"

    keys = [k for k in dict.fromkeys([*saved, *current])
            if (k in saved) != (k in current) or saved.get(k) != current.get(k)]  # fmt: skip
    return [f"{k}: {shown(saved, k)} in the checkpoint, {shown(current, k)} here" for k in keys]


def _check_model(path, saved: dict, current: dict) -> None:
    problems = []
    old, new = saved.get("tensors", {}), current["tensors"]
    missing = [k for k in old if k not in new]
    unexpected = [k for k in new if k not in old and k.rpartition(".")[2] not in _NEWER_ENTRIES]
    if missing:
        problems.append(f"entries only in the checkpoint: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"entries only here: {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    for k in old:
        if k in new and old[k] != new[k]:
            problems.append(f"{k}: shape {tuple(old[k][0])} {old[k][1]} in the checkpoint, {tuple(new[k][0])} "
                            f"{new[k][1]} here")  # fmt: skip
    if not problems and saved.get("trainable") != current["trainable"]:
        problems.append(f"trainable parameters {saved.get('trainable')} in the checkpoint, {current['trainable']} here")
    if problems:
        raise ValueError(f"checkpoint {path} is of another model: " + "; ".join(problems[:12]) + ". Load it into the "
                         "model it was saved from (same architecture, dtypes and frozen parameters)")  # fmt: skip


def _check_history(path, history: list, dp, steps_taken: int) -> None:
    """The accountant's history counts one event of this engine's per released step (else the file is corrupt)."""
    counted = sum(int(run[2]) for run in history)
    if counted != steps_taken:
        raise ValueError(f"checkpoint {path} is corrupt: its accountant counts {counted} steps, its optimizer released "
                         f"{steps_taken}")  # fmt: skip
    event = dp.variant.privacy_event()
    if event is None:
        return
    expected = (float(event[0]), float(event[1]), float(dp.projections))
    for run in history:
        got = (float(run[0]), float(run[1]), float(run[3]) if len(run) > 3 else math.inf)
        if got != expected:
            raise ValueError(f"checkpoint {path} is corrupt: its accountant holds steps (sigma, q, r) = {got}, but its "
                             f"settings release {expected}")  # fmt: skip


def load_checkpoint(
    engine,
    path: str | os.PathLike | io.IOBase,
    *,
    module: nn.Module,
    optimizer,
    data_loader=None,
) -> dict:
    """Resume the run saved at ``path`` into ``engine``, freshly made private with the same settings; returns the
    checkpoint's own entries (``extra`` / ``checkpoint_dict``). Refusals: module docstring. ``data_loader``: the loader
    ``make_private`` returned (required when the checkpoint holds a reproducible sampler's state)."""
    dp = _dp_optimizer(engine, optimizer)
    model = _model(dp, module)
    sampler = _sampler(data_loader, dp)
    state = _read(path)
    differ = _differences(state["settings"], privacy_settings(engine))
    if differ:
        raise ValueError(
            f"checkpoint {path} was saved with other privacy settings: " + "; ".join(differ) + ". A run resumes "
            "with the privacy settings it was saved with: the engine's epsilon assumes one setting for the whole run "
            "(its noise truncation bound uses the current noise multiplier for every step, and a sample rate means "
            "something else for another N), so it would be wrong. make_private with the checkpoint's settings, or "
            "start a new run with a new engine and accountant to change them"
        )
    released = max(dp.steps_taken, engine.accountant.steps)
    if released or dp.has_pending_sums:
        raise ValueError(
            f"this engine already released {released} step(s) (or holds clipped sums of skipped steps): load a "
            "checkpoint into a new engine, right after make_private. Its accountant would otherwise count steps the "
            "checkpoint counts too, or forget the steps behind the model it replaces"
        )
    _check_model(path, state["model_signature"], _model_signature(model))
    kind = type(dp.original_optimizer).__name__
    if state["optimizer_class"] != kind:
        raise ValueError(f"checkpoint {path} holds the state of a {state['optimizer_class']} optimizer, but this "
                         f"optimizer is a {kind}: resume with the same optimizer")  # fmt: skip
    saved_groups = [len(g.get("params", [])) for g in state["optimizer"].get("optimizer", {}).get("param_groups", [])]
    groups = [len(g["params"]) for g in dp.original_optimizer.param_groups]
    if saved_groups != groups:
        raise ValueError(f"checkpoint {path} holds an optimizer with parameter groups of sizes {saved_groups}, this "
                         f"one has {groups}: resume with the optimizer built the same way")  # fmt: skip
    steps_taken = state["optimizer"].get("steps_taken")
    if isinstance(steps_taken, bool) or not isinstance(steps_taken, int) or steps_taken < 0:
        raise ValueError(f"checkpoint {path} is corrupt: its optimizer's released steps are {steps_taken!r}")
    _check_history(path, state["accountant"].get("history", []), dp, steps_taken)
    keys = getattr(dp.variant, "keys", None)
    reproducible = keys is not None and keys.reproducible
    mode = state["noise_keys"].get("mode")
    if mode != ("reproducible" if reproducible else "os-entropy"):  # also in the settings: only a corrupt file
        raise ValueError(f"checkpoint {path} is corrupt: its noise keys are {mode!r}")
    saved_sampler = state["sampler"]
    if saved_sampler is not None and "generator" in saved_sampler and sampler is None:
        raise ValueError(
            f"checkpoint {path} holds a reproducible Poisson sampler's state: pass data_loader= (the loader "
            "make_private returned) so the batches continue where the saved run stopped, not again from step 0"
        )
    if sampler is not None and saved_sampler is None and sampler.reproducible:
        raise ValueError(f"checkpoint {path} holds no sampler state, but this loader samples reproducibly")
    # accountant first: should a later part fail, the engine over-counts, never under-counts
    engine.accountant.load_state_dict(state["accountant"])
    dp.load_state_dict(state["optimizer"])
    if keys is not None and steps_taken:
        keys.last_released = steps_taken - 1  # a reproducible key refuses a step at or below it (no key served twice)
    if sampler is not None and saved_sampler is not None:
        sampler.load_state_dict(saved_sampler)
    variant_state = dict(state["variant_state"])
    nonfinite = variant_state.pop("nonfinite_examples", None)
    if nonfinite is not None and hasattr(dp.variant, "nonfinite_examples"):
        dp.variant.nonfinite_examples = int(nonfinite)
    dp.variant.restore_checkpoint_state(variant_state)
    model.load_state_dict(state["model"])
    return state["extra"]
