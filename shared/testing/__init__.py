"""Test harness: a real nats-server fixture and unique subject roots (see fixtures.py)."""

from shared.testing.fixtures import unique_root

__all__ = ["unique_root"]
