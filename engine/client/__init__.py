"""The client side: how callers reach the core. ``LLM`` (offline, in-process), the async
engine (``AsyncLLMEngine``: per-request streams) and its core client, the core's loop on a
thread or in a child process (``core_loop``, ``core_process``), the messages between them
(``core_messages``), and beam search over the core's steps."""
