"""KV blocks beyond the engine that computed them: ``kv_transfer_config`` (vLLM's name) and the
``SharedStorageConnector``, a store of full prompt blocks on local storage that the engine's
replicas on a node share. docs/kv_transfer.md says how the pieces fit."""
