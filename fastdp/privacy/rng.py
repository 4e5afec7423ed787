"""Keys of the privacy draws: OS entropy by default, a reproducible seed only when asked for by name.

Every privacy draw of a variant (the noise of each release, JL's tangents) is keyed by a :class:`PrivacyKeys`:

* **Default (``reproducible_seed=None``): OS entropy.** Each release takes a fresh 126-bit Philox key and counter
  (two 63-bit ``secrets.randbits`` values); each step's JL tangent key is one 63-bit OS-entropy value drawn the
  first time the step is seen and shared by every micro-batch (and, data-parallel, every rank) of that step. The
  run cannot be replayed, and nobody, the code's authors included, can regenerate the noise of a published model.
* **Reproducible (``reproducible_seed=s``): NOT FOR RELEASE.** The noise of step t is keyed by (s, t), the tangents
  by (a key derived from s, t * r + j). Anyone who knows s (and the code) can regenerate the noise of a model and
  subtract it: for tests, debugging and bitwise resume checks, never for a model that is published. The result and
  :meth:`PrivacyKeys.label` say so. One key never serves a step twice: a second release at a step index already
  released (or an earlier one) is refused (a new :class:`PrivacyKeys`, e.g. a resumed run's, starts afresh: it
  redoes steps the killed run released but never saved, with the same batches and the same noise).

In both modes every noise value is the sum of 4 independent Box-Muller draws divided by 2 (``NOISE_DRAWS``): see
``docs/privacy-randomness.md`` for why (the single-draw normal is bounded at 6.76 standard deviations) and the
bound the trainer enforces on what remains (``fastdp.privacy.accounting.truncation_delta``).
"""

from __future__ import annotations

import numbers
import secrets

SEED_BITS = 63  # seeds and offsets are non-negative int64 values
NOISE_DRAWS = 4  # every DP release and every JL tangent: (n1 + n2 + n3 + n4) / 2
TANGENT_KEY = 0x4A4C_7461_6E67_656E  # mixed into the noise seed: the tangents' own stream ("JLtangen")
OS_ENTROPY = "os-entropy"
REPRODUCIBLE = "reproducible (NOT FOR RELEASE)"


def os_entropy_seed() -> int:
    """A fresh 63-bit value from the operating system's entropy source (``secrets``)."""
    return secrets.randbits(SEED_BITS)


def check_reproducible_seed(seed, what: str = "reproducible_seed") -> int | None:
    """``seed`` checked: None (OS entropy) or an int in [0, 2**63); ValueError otherwise, naming ``what``."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) < 2**SEED_BITS:
        raise ValueError(
            f"{what} must be None (privacy draws from OS entropy, the default) or an int in [0, 2**63) (reproducible "
            f"draws, NOT FOR RELEASE), got {seed!r}"
        )
    return int(seed)


def tangent_seed(seed: int) -> int:
    """Key of the reproducible JL tangent stream for noise seed ``seed`` (a different Philox key: independent of
    the noise)."""
    return (seed ^ TANGENT_KEY) & ((1 << SEED_BITS) - 1)


class PrivacyKeys:
    """The keys of one variant's privacy draws; see the module docstring.

    Args:
        reproducible_seed: None (default): every key from OS entropy. An int in [0, 2**63): reproducible keys,
            NOT FOR RELEASE.
    """

    def __init__(self, reproducible_seed: int | None = None) -> None:
        self.reproducible_seed = check_reproducible_seed(reproducible_seed)
        self.last_released: int | None = None  # the last step index a release was keyed for
        self._tangent: tuple[int, int] | None = None  # OS entropy: (step, key) of the step under way

    @property
    def reproducible(self) -> bool:
        return self.reproducible_seed is not None

    @property
    def label(self) -> str:
        """``"os-entropy"`` or ``"reproducible (NOT FOR RELEASE)"``: for results and ``describe()``."""
        return REPRODUCIBLE if self.reproducible else OS_ENTROPY

    def __repr__(self) -> str:
        return f"PrivacyKeys({self.label})"

    @staticmethod
    def _check_step(step) -> int:
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= int(step) < 2**SEED_BITS:
            raise ValueError(f"the step index must be an int in [0, 2**63), got {step!r}")
        return int(step)

    def noise_key(self, step: int) -> tuple[int, int]:
        """(seed, offset) of the noise of the release at ``step``. OS entropy: two fresh 63-bit values. Reproducible:
        (the seed, ``step``), refused for a step index at or below one already released (it would repeat or
        interleave that noise stream: the same key serving two releases)."""
        step = self._check_step(step)
        if self.reproducible:
            if self.last_released is not None and step <= self.last_released:
                raise ValueError(
                    f"refusing a release at step {step}: this variant already released step {self.last_released} "
                    "with its reproducible noise key, and a second release at a step index at or below it would "
                    "reuse noise (whoever sees both can subtract one from the other). Use a new step index (the "
                    "trainer numbers steps 0, 1, 2, ...), or the default OS-entropy keys (reproducible_seed=None)"
                )
            self.last_released = step
            self._tangent = None
            return self.reproducible_seed, step
        self.last_released = step
        self._tangent = None  # the step is released: a later step (or a repeat of this one) gets fresh tangents
        return os_entropy_seed(), os_entropy_seed()

    def tangent_key(self, step: int, projections: int) -> tuple[int, int]:
        """(seed, first counter) of the JL tangents of ``step``: tangent j is counter ``first + j``. OS entropy: one
        key per step, drawn the first time the step is seen and kept until its release, so every micro-batch of the
        step projects on the same tangents. Reproducible: (``tangent_seed(seed)``, ``step * projections``)."""
        step = self._check_step(step)
        if self.reproducible:
            return tangent_seed(self.reproducible_seed), step * projections
        if self._tangent is None or self._tangent[0] != step:
            self._tangent = (step, os_entropy_seed())
        return self._tangent[1], 0

    def adopt_tangent_key(self, step: int, key: int) -> None:
        """Use ``key`` (another process's :meth:`tangent_key` of ``step``, OS-entropy mode) for this step's tangents:
        data-parallel ranks share the step's tangents as micro-batches do."""
        if not self.reproducible:
            self._tangent = (self._check_step(step), check_reproducible_seed(key, "tangent key"))
