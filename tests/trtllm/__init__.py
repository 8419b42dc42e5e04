"""A replay of TensorRT-LLM's PyTorch executor for testing KV cache connectors without it.

``driver.Driver`` calls a connector (``KvCacheConnectorScheduler`` on rank 0, one
``KvCacheConnectorWorker`` per rank) exactly in the order, with the arguments and under the
rules of TensorRT-LLM's executor loop, against a paged KV pool in TensorRT-LLM's layout, a device
block allocator that reuses and evicts, and a deterministic model whose KV for every position is
known, so every onboarded block is checked bit for bit. ``standins/`` holds the ``tensorrt_llm``
names a connector imports. ``TRTLLM_API.md`` documents the interface replayed, with citations.
"""
