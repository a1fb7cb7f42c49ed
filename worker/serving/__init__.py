"""What the prefill and decode services share beyond the engine: the worker's store, KV
pages moved between the pool, the store and NIXL staging, and staging space."""
