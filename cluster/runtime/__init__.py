"""Ray-side execution of one engine: the ``RayExecutor`` behind ``engine.worker.executor``, its
worker actors, the per-step dispatch (actor calls or a compiled graph), placement arithmetic and the
load-progress publisher. Imports ``cluster.api`` and ``cluster.config`` at most; knows no Serve."""
