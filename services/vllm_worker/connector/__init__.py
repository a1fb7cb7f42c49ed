"""kvfabric's SSD tier and kv-index as vLLM's KV connector (`connector.KvfabricConnector`).

Loaded by vLLM, in vLLM's own environment (`services.vllm_worker.vllm_env`), through
`--kv-transfer-config` with `kv_connector_module_path` = `services.vllm_worker.connector.connector`:
only `connector.py` imports vLLM. `scheduler_side.py` decides each request's loads and
saves; `params.py` is what the vllm-worker hands it per request (the prompt's chain and the
router's match); `layout.py` converts between vLLM's paged KV cache and the store's block
payload; `loop.py` runs our asyncio clients (the bus, the store) beside vLLM's synchronous
hooks.
"""
