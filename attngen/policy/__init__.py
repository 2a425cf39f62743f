"""Decisions and tables that rewrite no IR: launch configs (`configs`), split counts (`splits`), which kernels
read through TMA descriptors (`tma`)."""
