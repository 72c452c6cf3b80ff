"""``WorkerActor``: one engine ``Worker`` (one GPU, or one CPU bundle) inside a Ray actor.

The class is plain Python; ``RayExecutor`` wraps it with ``ray.remote`` and the resources of
its bundle. Start-up calls (config, rendezvous, loading) travel through Ray's own transport;
the per-step message is the msgspec-encoded ``ExecuteModelRequest`` and the reply the
msgspec-encoded ``ModelRunnerOutput``, so no project object is pickled on the hot path.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from engine.config import EngineConfig
from engine.protocol import decode_request, encode
from engine.worker import Worker

logger = logging.getLogger("llm_cluster.worker_actor")


class WorkerActor:
    """Rank ``rank`` of the TP x PP world. Lifecycle, driven by the executor:
    ``init_device`` -> (rank 0) ``start_rendezvous`` -> ``init_distributed`` -> ``load_model``
    -> ``determine_num_available_blocks`` -> ``initialize_cache`` -> ``execute_model`` per step.
    """

    def __init__(self, config: EngineConfig, rank: int) -> None:
        parallel = dataclasses.replace(config.parallel, rank=rank)
        self.worker = Worker(dataclasses.replace(config, parallel=parallel))

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def init_device(self) -> None:
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always index 0.
        self.worker.init_device(0)

    def start_rendezvous(self, timeout_s: float) -> tuple[str, int]:
        """Host the rendezvous store on this node's address; (address, OS-assigned port)."""
        host = self.node_ip()
        return host, self.worker.start_rendezvous(host, timeout_s)

    def execute_model(self, request: bytes) -> bytes | None:
        output = self.worker.execute_model(decode_request(request))
        return encode(output) if output is not None else None

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``collective_rpc`` target: a public method of the wrapped ``Worker``."""
        if method.startswith("_") or not callable(getattr(self.worker, method, None)):
            raise AttributeError(f"method: Worker has no public method {method!r}")
        return getattr(self.worker, method)(*args, **kwargs)

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.worker.shutdown()
