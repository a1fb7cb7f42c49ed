"""The planning model of a kvfabric deployment (`kvfabric plan`, the simulator): what a
day's traffic needs in GPUs, servers, SSD and control-plane capacity, and what it earns."""

from services.admin.plan.inputs import (
    REFERENCE_OUTPUT_TOKENS_PER_REQUEST,
    PlanError,
    PlanInputs,
)
from services.admin.plan.model import ControlPlane, Fleet, Money, Plan, Storage, Traffic, plan

__all__ = [
    "REFERENCE_OUTPUT_TOKENS_PER_REQUEST",
    "ControlPlane",
    "Fleet",
    "Money",
    "Plan",
    "PlanError",
    "PlanInputs",
    "Storage",
    "Traffic",
    "plan",
]
