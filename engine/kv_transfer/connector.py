"""The configured connector's two sides: ``kv_connector`` picks the head's part (which blocks
come from elsewhere, which go out) and each worker's (moving the bytes). Both connectors
implement the same interface, so the scheduler and the model runner drive either one:

    SharedStorageConnector   KVTransferScheduler  /  WorkerKVTransfer     (files on the node)
    NixlConnector            NixlScheduler        /  NixlWorkerTransfer   (NIXL READ)
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.kv_transfer.nixl import NixlScheduler
from engine.kv_transfer.nixl_worker import NixlWorkerTransfer
from engine.kv_transfer.scheduler import KVTransferScheduler
from engine.kv_transfer.worker import WorkerKVTransfer

KVConnectorScheduler = KVTransferScheduler | NixlScheduler
WorkerKVConnector = WorkerKVTransfer | NixlWorkerTransfer


def _is_nixl(config: EngineConfig) -> bool:
    kv = config.kv_transfer.kv_transfer_config
    return kv is not None and kv.kv_connector == "NixlConnector"


def make_kv_scheduler(config: EngineConfig, block_manager: BlockManager) -> KVConnectorScheduler:
    """The head side of the configured connector."""
    if _is_nixl(config):
        return NixlScheduler(config, block_manager)
    return KVTransferScheduler(config, block_manager)


def make_worker_kv_transfer(
    config: EngineConfig, stage: int, tp_rank: int, tp_size: int, num_model_caches: int
) -> WorkerKVConnector:
    """A worker's side of the configured connector (NIXL is imported only for NixlConnector)."""
    if _is_nixl(config):
        return NixlWorkerTransfer(config, stage, tp_rank, tp_size, num_model_caches)
    return WorkerKVTransfer(config, stage, tp_rank, tp_size, num_model_caches)
