"""The mock engine (`--engine mock`, Dynamo's "mocker"): the real workers and engine over a
simulated model (simulated.py): real KV bytes, deterministic tokens, time from the cost
model. Import `worker.mock_engine.simulated` (it imports torch)."""
