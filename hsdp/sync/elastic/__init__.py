"""The sync group on torchft: replicas that die and rejoin (elastic.enabled, docs/design.md §11).

Each replica is its own torch.distributed world of `mesh.shard` ranks. Shard rank r of every replica
holds the same slice of the model, so rank r's torchft `Manager` joins the quorum of the r-th ranks of
all live replicas (replica id `replica_<m>`), and its reconfigurable gloo group carries the sync
collectives among them. One job per module:

    transport.py    FTTransport: that group behind the policy's `Transport` (rounds, spectators, counts)
    heal.py         HealState: what a rejoining replica copies from a live peer, and its snapshot server
    straggler.py    RoundBound: elastic.round_timeout_s (who counts in a round, when a slow replica cuts)
    join.py         the first quorum of a replica, and the out-of-band catch-up of one healed at a param sync
    manager.py      the torchft Manager of a rank (lighthouse, timeouts) and the address peers reach it at
    rejoin.py       Rejoin: a replica cut off mid-run (its link, the lighthouse) that gets a quorum again heals
    membership.py   ElasticMembership: the above as this rank's `Membership` (hsdp/sync/membership.py)
"""
