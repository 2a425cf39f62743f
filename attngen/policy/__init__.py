"""Decisions and tables that rewrite no IR: launch configs (`configs`), split counts (`splits`), which kernels
read through TMA descriptors (`tma`), and the Hopper Gluon kernels' shapes and thresholds (`hopper`)."""
