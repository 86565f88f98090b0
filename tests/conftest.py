"""Session-wide test setup that must happen before any test module imports triton."""

import os

import torch

# Triton reads TRITON_INTERPRET when it is first imported, and transformers may import it while a
# model test loads; set it here, before collection, so the kernel tests never depend on file order.
# On a CUDA machine the kernels compile instead (make gpu-check).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
