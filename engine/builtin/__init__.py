"""Built-in models: random-weight checkpoints in HF format with a real tokenizer, written
locally (never downloaded), for demos, tests and benchmarks. ``catalog`` resolves the
built-in names (``tiny-llama`` and the others) to a directory it writes once into the cache."""
