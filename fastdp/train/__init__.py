"""Training utilities: data sets and models for DP training."""
