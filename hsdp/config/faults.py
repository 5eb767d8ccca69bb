"""`elastic.faults`' syntax is the one fault grammar of hsdp/faults/spec.py (docs/design.md §9.4): re-exported here."""

from hsdp.faults.spec import POINTS, Fault, FaultSpecError, Place, parse_fault, parse_faults

__all__ = ["POINTS", "Fault", "FaultSpecError", "Place", "parse_fault", "parse_faults"]
