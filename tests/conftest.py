"""Session-wide test setup.

Without CUDA, Triton kernels run on CPU tensors through the Triton interpreter. The switch is
read when a kernel module is imported (its ``@triton.jit`` decides then), so it is set here,
before any test module imports ``kernels.triton_*``. With CUDA the kernels compile for the GPU.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
