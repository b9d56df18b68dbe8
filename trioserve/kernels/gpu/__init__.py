"""Triton twins of the forward pass's operations, for CUDA devices (issue
#14). Each module here holds kernels and a Python wrapper with the very
signature of the op's CPU implementation (kernels/native.py, or the torch
reference in kernels/reference.py and models/sampling.py), so the seam
(kernels/ops.py) can choose per device.

Importing these modules needs triton; launching a kernel needs a CUDA
device, or TRITON_INTERPRET=1 set before the module is imported (the
interpreter runs them on CPU tensors, exactly for float32 and float16,
wrongly for bfloat16, and 400-3000 times slower than torch). The tests
set it (tests/conftest.py) where no GPU is present."""
