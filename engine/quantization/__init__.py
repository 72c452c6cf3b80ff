"""Quantized checkpoints (compressed-tensors, GPTQ, AWQ, block FP8, MXFP4 experts) and online
FP8: the config parser (torch-free, ``config``), the tensor formats (``formats``) and the
load-time conversion (``loading``; ``mxfp4`` for gpt-oss's experts)."""
