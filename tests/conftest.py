"""Session-wide test setup.

Triton chooses its interpreter when it is first imported, and test modules import it at
collection (fla, in test_known_models.py, imports triton). So on a machine without CUDA the
choice is made here, before any test module: TRITON_INTERPRET=1 runs the Triton backend's
kernels on the CPU (tests/test_triton.py). Nothing else in the suite launches a kernel.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
