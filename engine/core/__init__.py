"""The scheduling core: ``LLMEngine`` (one step: schedule, send to the executor, take the
output) with what it owns on the head — the scheduler, the block manager and its KV cache
groups, the requests, the grammars it tracks, and the input checks and output state
(detokenization) of each request. Nothing here runs a model; the workers do
(``engine.worker``), reached through the ``Executor`` interface."""
