"""Suite-wide setup: without a CUDA device, Triton kernels run under its interpreter.

TRITON_INTERPRET is read when triton first compiles a kernel's launcher, so it must be set before any test
module (of any folder) imports code that imports triton — hence here, at the root, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
