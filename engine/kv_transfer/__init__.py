"""KV blocks beyond the engine that computed them: ``kv_transfer_config`` (vLLM's name) with
``SharedStorageConnector``, a store of full prompt blocks on local storage that the engine's
replicas on a node share, or ``NixlConnector``, a decode engine reading a prefill engine's
blocks with NIXL. docs/kv_transfer.md says how the pieces fit."""
