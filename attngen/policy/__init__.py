"""Decisions and tables that rewrite no IR: launch configs (`configs`), split counts (`splits`), TMA (`tma`)."""
