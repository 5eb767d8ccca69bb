"""`torchft_lighthouse` without torch: run as a script (`python hsdp/run/torchft_lighthouse.py ARGS`), the same
lighthouse as torchft's console script, started in 0.03 CPU s instead of 1.2.

torchft's script imports `torchft._torchft`, whose package `__init__` imports torch; the lighthouse is all in the
Rust extension, so this loads that extension module alone and hands it the arguments (`lighthouse_main` reads
sys.argv). It imports nothing of hsdp: an elastic run starts one per run and one per lighthouse restart.
"""

import glob
import importlib.machinery
import importlib.util
import sys


def main() -> int:
    spec = importlib.util.find_spec("torchft")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        print("torchft_lighthouse: torchft is not installed", file=sys.stderr)
        return 1
    found = sorted(glob.glob(f"{spec.submodule_search_locations[0]}/_torchft*.so"))
    if not found:
        print("torchft_lighthouse: torchft's _torchft extension is missing", file=sys.stderr)
        return 1
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", found[0])
    extension = importlib.util.spec_from_loader("torchft._torchft", loader)
    assert extension is not None  # a loader was given
    module = importlib.util.module_from_spec(extension)
    loader.exec_module(module)
    sys.argv = ["torchft_lighthouse", *sys.argv[1:]]
    return int(module.lighthouse_main() or 0)


if __name__ == "__main__":
    sys.exit(main())
