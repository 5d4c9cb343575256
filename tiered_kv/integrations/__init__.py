"""Glue between tiered_kv and serving stacks.

`tiered_kv.integrations.vllm` holds `TieredKVConnector`, vLLM's ``KVConnectorBase_V1`` (needs the
``vllm`` extra), and `kv_events` vLLM's KV events for routers. The other modules here are
stack-neutral and never import a serving stack:
`engine_host` (an engine on its own loop thread, for callers that are plain threads; its parts:
`host_lookups`, `layer_groups`, `tier_watch`, `host_stats`) and `lookup_channel` (the local
socket over which a scheduler process asks the workers' engines).
Importing tiered_kv or this package never imports vLLM.
"""
