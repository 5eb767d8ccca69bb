"""The sync group on torchft: replicas that die and rejoin (elastic.enabled, docs/design.md §9).

Each replica is its own torch.distributed world of `mesh.shard` ranks. Shard rank r of every replica
holds the same slice of the model, so rank r's torchft `Manager` joins the quorum of the r-th ranks of
all live replicas (replica id `replica_<m>`), and its reconfigurable gloo group carries the sync
collectives among them. One job per module:

    phase.py        the phases of a replica's life and every transition (the table); a round's, a heal's
    replica.py      ElasticReplica: the one owner of that life, the training loop's `Membership` (join, heal
                    out of band, rejoin after a cut, the straggler cuts, the summary's fields)
    transport.py    FTTransport: torchft's group behind the policy's `Transport` (a round's life, its collectives)
    quorum.py       Quorum: a round's quorum (paused while cut off, a restarted lighthouse) and who counts in it
    seam.py         the torchft seam: Protocols of what the wing calls (Manager, ProcessGroup, Work, Snapshots)
    heal.py         HealState: what a rejoining replica copies from a live peer, and its snapshot server
    closing.py      RunClose: the run's close, one model at the end (meetings, a whole heal, the verdict)
    straggler.py    RoundBound: elastic.round_timeout_s (who counts in a round, when a slow replica cuts)
    manager.py      the torchft Manager of a rank (lighthouse, timeouts) and the address peers reach it at
    faults.py       FaultPoints: elastic.faults done at the named points a replica passes
    lighthouse.py   whether the lighthouse accepts connections

This module is what the launcher (hsdp/run/replicas.py) and the slow-link benchmark's checks (hsdp/bench/
chaos.py: whether a run closes level, each replica's verdict) use of the wing: nothing else of it is imported
outside hsdp/sync.
"""

from hsdp.sync.elastic.closing import ReplicasDiffer, closes_level, verdicts
from hsdp.sync.elastic.faults import clear_markers, died_at
from hsdp.sync.elastic.lighthouse import in_words, lighthouse_unreachable, wait_for_lighthouse

__all__ = [
    "ReplicasDiffer",
    "clear_markers",
    "closes_level",
    "died_at",
    "in_words",
    "lighthouse_unreachable",
    "verdicts",
    "wait_for_lighthouse",
]
