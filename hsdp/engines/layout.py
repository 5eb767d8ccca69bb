"""Moved to hsdp/layout.py, below hsdp.compile (whose traced step reads the same layout).

This name stays only until hsdp/engines/hsdp.py and tests/test_passes.py import from hsdp.layout.
"""

from hsdp.layout import DTYPES, ParamSpec, UnitLayout, plan_layout  # noqa: F401
