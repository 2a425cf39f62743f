"""Numerics against float64: the `reference` implementation and the `accuracy` checks built on it."""
