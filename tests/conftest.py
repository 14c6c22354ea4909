from __future__ import annotations

import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Without a GPU the kernel tests run Triton under its CPU interpreter. The flag must be set
# before triton is first imported, and collecting the Hugging Face tests imports it (a modeling
# file imports torch._dynamo, which imports triton): so here, before any test module loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
