"""The sync layer: everything that crosses the sync group (replicas), as one component.

schedule.py   when (warmup grad sync, every H, fragments, delay τ)
outer.py      what θ_g does with the mean Δ (average / DiLoCo outer step)
codec.py      how Δ travels (fp32 all-reduce / int8 all-gather)
transport.py  over what (a protocol; the c10d sync group implements it)
policy.py     the policy combining them, its checkpoint state, resume rules and NoSync
"""
