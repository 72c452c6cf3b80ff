"""The worker side: what runs the model for a step. The ``Executor`` interface and the
in-process executor, the per-step wire messages (``step_messages``), the ``Worker`` and its
``ModelRunner`` (inputs, forward, sampler, CUDA graphs), the paged KV cache it holds
(``cache_engine``), loading weights, and sizing the KV cache (``kv_sizing``, and the
torch-free ``memory_plan`` that ``cluster plan`` prints)."""
