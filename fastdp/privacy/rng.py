"""Seeds for the noise stream."""

import secrets

SEED_BITS = 63  # seeds and offsets are non-negative int64 values


def os_entropy_seed() -> int:
    """A fresh 63-bit value from the operating system's entropy source (``secrets``)."""
    return secrets.randbits(SEED_BITS)
