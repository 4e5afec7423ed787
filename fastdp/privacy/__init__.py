"""Privacy machinery: randomness sources (accountants and samplers come with the trainer)."""
