"""Triton kernels and their launchers, one module per op; dispatch.py holds the launch
policy (forms, tiles, warps, programmatic launch)."""
