"""The production trace (loadtest/data/) replayed: synthetic prompts from its hash ids
(synth.py), offline through the router's policy and kv-index's index (offline.py), and live
through a mock-engine cluster (live.py); `python -m loadtest.bench_trace` runs both."""
