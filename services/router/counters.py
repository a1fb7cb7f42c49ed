"""What the router counts, shown by discovery (STATS) and `kvfabric status --json`."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RouterCounters:
    num_routed: int = 0  # requests a decode worker accepted (a RouteDecision was replied)
    num_hit_tokens: int = 0  # cached prompt tokens of the routed requests
    num_prompt_tokens: int = 0  # prompt tokens of the routed requests
    num_cold_index: int = 0  # requests routed without a kv-index answer
    num_retries: int = 0  # prefill jobs sent again to another worker
    num_failed: int = 0  # routed requests whose prefill failed for good (CancelRequest sent)
    num_rejected: Counter[str] = field(default_factory=Counter)  # error replies, by code

    def as_dict(self) -> dict[str, Any]:
        flat: dict[str, Any] = {
            name: value for name, value in vars(self).items() if name != "num_rejected"
        }
        flat["num_rejected"] = sum(self.num_rejected.values())
        for code, count in sorted(self.num_rejected.items()):
            flat[f"num_rejected_{code.lower()}"] = count
        return flat
