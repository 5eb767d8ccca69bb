import os
import sys

# Triton reads TRITON_INTERPRET at import: set it before any test module imports kernels.
os.environ.setdefault("TRITON_INTERPRET", "1")
# torch.compile in tests: one compile worker per rank (2 cores), so ranks do not fight over the CPU.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# OpenMP's idle threads sleep instead of spinning. The suite runs 3 workers and their ranks on 2 cores, so a
# process with 2 threads (a one-worker run, a test computing in process) nearly always shares its cores: an idle
# thread spinning for its next parallel region takes the CPU its own or another test's work needed (a one-worker
# tiny-bpe run: 12.8 CPU s spinning, 4.7 sleeping, beside other tests). The threads compute the same either way.
# Read when libgomp loads (with torch): set before any test module imports torch; subprocesses inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Inductor's caches in one fresh folder per suite run (set here, before xdist starts its workers, who
# inherit it): a compile is cold unless an earlier run in this suite compiled the same graph or kernels
# (tests of warm compiles rely on that), whatever the machine's own cache holds.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="hsdp-inductor-")
    atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)

# Where PYTHONDONTWRITEBYTECODE is set (this box's sessions set it), Python reads bytecode but never writes
# it: every fresh interpreter the suite starts (elastic replicas and their restarts, torchrun workers,
# slow-link nodes) would compile the project's modules from source again (0.15-0.2 CPU s each). Compiled once
# here (up-to-date files are skipped; the writes are atomic, so xdist's workers may race).
if sys.dont_write_bytecode:
    import compileall
    from pathlib import Path

    _REPO = Path(__file__).resolve().parents[1]
    for _package in ("hsdp", "kernels"):
        compileall.compile_dir(_REPO / _package, quiet=1)
    compileall.compile_file(_REPO / "train.py", quiet=1)


# The suite's longest modules, longest first: by the wall time each takes alone on the 2-core box, with the
# modules that wait more than they compute moved up (test_paced sleeps through most of its 90 s; the README's
# commands run one after another and stretch most when the box is loaded). xdist's
# --dist loadfile hands out whole modules in collection order (pyproject's --no-loadscope-reorder:
# xdist would otherwise start the modules with the most tests first, and a 5-minute module with
# 14 tests last); starting the long ones first keeps one of them from being the run's tail.
LONGEST_FIRST = (
    "test_compile.py",
    "test_exactness.py",
    "test_elastic.py",
    "test_elastic_end.py",
    "test_results_commands.py",
    "test_counts_agree.py",
    "test_readme_commands.py",
    "test_paced.py",
    "test_compile_passes.py",
    "test_slowlink.py",
    "test_never_lose.py",
    "test_three_level.py",
    "test_checkpoint.py",
    "test_llama.py",
    "test_elastic_faults.py",
    "test_engine.py",
    "test_kernels.py",
    "test_compile_blocks.py",
    "test_sync.py",
    "test_elastic_resume.py",
    "test_torchft_parity.py",
    "test_compress.py",
    "test_sparseloco.py",
    "test_robustness.py",
    "test_elastic_heal.py",
    "test_sample.py",
    "test_measures.py",
    "test_hf.py",
    "test_config.py",
    "test_elastic_straggler.py",
    "test_signals.py",
    "test_corrupt_checkpoints.py",
    "test_finished_runs.py",
    "test_full_disk.py",
    "test_outer_options.py",
    "test_torch_compat.py",
    "test_steady_rate.py",
    "test_plan_uneven.py",
    "test_plan.py",
)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
