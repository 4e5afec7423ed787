"""Pure-torch reference implementations: obviously correct, float64-capable, any device."""
