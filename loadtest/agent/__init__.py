"""The coding-agent load generator: seeded sessions (`workload`), run over HTTP through the
official SDKs (`runner`), measured and plotted (`report`, `plots`); `loadtest.bench_agent` is
the benchmark built on it."""

from loadtest.agent.plots import write_plots
from loadtest.agent.report import AgentReport, RequestRecord
from loadtest.agent.runner import Target, run_agents
from loadtest.agent.workload import AgentSession, Message, Workload

__all__ = [
    "AgentReport",
    "AgentSession",
    "Message",
    "RequestRecord",
    "Target",
    "Workload",
    "run_agents",
    "write_plots",
]
