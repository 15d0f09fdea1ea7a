"""Numba CPU kernels. Internal: call them through the public functions in :mod:`fp4sim`."""
