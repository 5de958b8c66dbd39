"""Shared Triton stages: chunk cumsum, UT/WY transform, inter-chunk state recurrence, TFLA tiled output."""
