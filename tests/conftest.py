import os

# Triton reads TRITON_INTERPRET at import: set it before any test module imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
