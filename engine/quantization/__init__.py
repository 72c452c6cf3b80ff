"""Quantized checkpoints (compressed-tensors, GPTQ, AWQ) and online FP8: the config parser
(torch-free, ``config``), the tensor formats (``formats``) and the load-time conversion
(``loading``)."""
