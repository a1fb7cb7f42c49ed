"""The systems a user would deploy instead of kvfabric, run beside it in the same benchmark.

Each peer lives in a virtual environment of its own (`venvs.ensure_venv`): their pins differ
from ours, and nothing of theirs is imported into our process.
"""
