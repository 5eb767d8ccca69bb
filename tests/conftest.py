import os

# Triton reads TRITON_INTERPRET at import: set it before any test module imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile in tests: one compile worker per rank (2 cores), so ranks do not fight over the CPU.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's caches in a fresh folder per test process: a test's compile is cold unless an earlier
# run of the same module compiled the same graph (tests of warm compiles rely on that), whatever
# the machine's own cache holds.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hsdp-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)
