"""Triton kernels and their host launchers; imported lazily, only when a Triton path runs."""
