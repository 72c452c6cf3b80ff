"""Multimodal inputs on the head: images in a prompt turned into the model's placeholder tokens
and preprocessed pixels (``processor``), OpenAI-style chat content parts (``chat``), and the
per-image record that travels to the workers once (``inputs``)."""
