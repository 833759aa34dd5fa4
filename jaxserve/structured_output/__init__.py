"""Grammar-constrained decoding with llguidance: constraints, per-step token masks, and the child
process that compiles each grammar first, with a deadline."""
