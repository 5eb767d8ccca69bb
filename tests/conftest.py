import os

# Triton reads TRITON_INTERPRET at import: set it before any test module imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile in tests: one compile worker per rank (2 cores), so ranks do not fight over the CPU.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
