"""Triton chunk templates and shared building blocks (installed as `miras.kernels`).

Empty until the Triton backend lands; emitted kernels are cached outside the repository.
"""
