"""tiered_kv as a vLLM (v1) KV connector: `TieredKVConnector`.

Load it with::

    KVTransferConfig(kv_connector="TieredKVConnector",
                     kv_connector_module_path="tiered_kv.integrations.vllm",
                     kv_role="kv_both",  # or kv_producer (store only) / kv_consumer (load only)
                     kv_connector_extra_config={"chunk_size": 256, "l2_path": "/var/cache/tkv"})

vLLM creates the connector twice, in different processes; each instance holds one half:

- `connector`: `TieredKVConnector`, the class vLLM instantiates; forwards each hook to the
  half for its role;
- `scheduler`: `SchedulerHalf`, lookups over the channel, claims, each step's plan;
- `worker`: `WorkerHalf`, the engine next to vLLM's KV caches, loads and stores, prefill timing;
- `metadata`: the plan the scheduler sends the workers each step (`TieredKVMetadata`);
- `stats`: the counters vLLM aggregates and logs (`TieredKVConnectorStats`);
- `config`: what both halves read from vLLM's config and ``kv_connector_extra_config``.

Chunk keys carry what changes KV beyond the tokens: the model's fingerprint (computed from its
config and weight files unless given, `default_fingerprint`) and each request's `KeySalt`
(cache salt, LoRA adapter, multimodal items: `request_salt`). A tiered_kv failure never fails a
request: it is a miss, or blocks vLLM recomputes. Only this package and
`integrations.kv_events` import vLLM; importing tiered_kv never imports them.
"""

from tiered_kv.integrations.vllm.connector import TieredKVConnector

__all__ = ["TieredKVConnector"]
