"""`kvfabric simulate`: a discrete-event model of a whole cluster driven by the production
router policy and kv-index (docs/simulator.md)."""

from simulator.config import SimConfig, WorkloadConfig
from simulator.report import Ledger, Window
from simulator.simulation import Simulation

__all__ = ["Ledger", "SimConfig", "Simulation", "Window", "WorkloadConfig"]
