"""Triton kernels (one op per module, with a launcher) and their plain-torch references."""
