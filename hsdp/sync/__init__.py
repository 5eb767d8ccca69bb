"""The sync layer: everything that crosses the sync group (replicas), as one component.

schedule.py   when (warmup grad sync, every H, fragments, delay τ)
outer.py      what θ_g does with the mean Δ (average / DiLoCo outer step)
codec.py      how Δ travels (fp32 all-reduce per unit; int8, int4, int2, top-k: one all-gather per round)
policy.py     the policy combining them (one round: start → land → apply), resume rules and NoSync
state.py      its state (θ_g, b, e, syncs in flight) as one object with one state_dict
membership.py this rank's place among the replicas (mesh, join, per-step duties; local or elastic)
elastic/      the replicas on torchft (docs/design.md §9)

Over what Δ travels is the mesh's transport (hsdp/comm/transport.py: the protocol, the c10d sync group).
"""
