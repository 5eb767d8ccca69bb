"""What the kernel test modules share (tests/test_kernels_compress.py, tests/test_sparseloco_kernels.py): the
backend switch, and the sm_90 code generation check (no GPU needed). No tests of its own.

TRITON_INTERPRET=1 is set before triton/kernels are imported (see tests/test_kernels.py), here too: pytest may
collect this module first.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

from kernels import backend  # noqa: E402

# Compiles each case for sm_90 with triton's bundled ptxas and prints PTX facts as JSON. It runs in a fresh
# process without TRITON_INTERPRET: triton decides interpret mode when triton.language is imported, and the
# interpreter patches it in place.
AOT_SCRIPT = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
facts = {}
for name, (mod, kname, sig, consts, opts) in json.loads(sys.argv[1]).items():
    fn = getattr(importlib.import_module(mod), kname)
    try:
        src = ASTSource(fn, {**sig, **{k: "constexpr" for k in consts}}, consts)
        ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]
    except Exception as e:
        facts[name] = {"error": f"{type(e).__name__}: {e}"}
        continue
    facts[name] = {"fma": "fma.rn.f32" in ptx, "div_rn": "div.rn.f32" in ptx,
                   "approx_div": "div.full.f32" in ptx or "div.approx.f32" in ptx}
print(json.dumps(facts))
"""


@pytest.fixture(autouse=True)
def _restore_backend():
    old = backend.get_backend()
    yield
    backend.set_backend(old)


def on(name: str, fn, *args):
    """Run fn under kernel backend `name`."""
    backend.set_backend(name)
    try:
        return fn(*args)
    finally:
        backend.set_backend("auto")


def sm90_facts_of(cases: dict) -> dict:
    """name -> PTX facts (fma, div_rn, approx_div; or error) of each case (module, kernel, signature, constexprs,
    options) compiled for sm_90 in a subprocess; skips the test where triton cannot compile for sm_90 here."""
    pytest.importorskip("triton.backends.nvidia", reason="triton without the NVIDIA backend")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root
    res = subprocess.run(
        [sys.executable, "-c", AOT_SCRIPT, json.dumps(cases)], env=env, capture_output=True, text=True, timeout=300
    )
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["?"])[-1]
        if "ptxas" in res.stderr or "ImportError" in last:
            pytest.skip(f"cannot compile for sm_90 here: {last}")
        raise AssertionError(res.stderr)
    facts = json.loads(res.stdout.strip().splitlines()[-1])
    if any("ptxas" in f.get("error", "") for f in facts.values()):
        pytest.skip("triton's ptxas is not usable here")
    return facts


def assert_exact_codegen(facts: dict, div_rn: bool) -> None:
    """One case compiled, with no fused multiply-add, no approximate division, and div.rn.f32 iff `div_rn`."""
    assert "error" not in facts, facts.get("error")
    assert not facts["fma"] and not facts["approx_div"]
    assert facts["div_rn"] == div_rn
