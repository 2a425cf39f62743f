"""Decisions and tables the passes read: tile shapes, thresholds and split counts per GPU; no IR rewriting."""
