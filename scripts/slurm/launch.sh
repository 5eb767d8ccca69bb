#!/usr/bin/env bash
# One host's part of an elastic run across machines (docs/usage.md "Across hosts"). Run by
# scripts/slurm/elastic.sbatch through srun, once per host, and by tests/test_multihost.py the same way
# (one network namespace per host): the same command lines on a cluster and in the test.
#
#   launch.sh lighthouse      the lighthouse's host: prepare the run folder, then run the lighthouse
#   launch.sh site M          a node of replica (site) M: wait for the lighthouse, then torchrun
#
# Environment (elastic.sbatch sets the first three; the rest have defaults):
#   HSDP_CONFIG         the run's config                                  (configs/tiny.yaml)
#   HSDP_SET            its overrides, space-separated k=v (the same on every host: a replica refuses a
#                       run folder prepared for another config)
#   HSDP_LIGHTHOUSE     the lighthouse's address, http://HOST:PORT (sites; HOST is the lighthouse's host)
#   HSDP_LIGHTHOUSE_PORT  the port the lighthouse listens on              (29510)
#   HSDP_NPROC          ranks on this node: mesh.replicate x mesh.shard / nodes per site   (1)
#   HSDP_ADDR           this node's address the other hosts reach it at  ($(hostname))
#   HSDP_RDZV_PORT      the site's torchrun rendezvous port              (29400)
#   HSDP_MAX_RESTARTS   torchrun restarts of a failed replica            (3)
#   PYTHON              the interpreter with hsdp's requirements         (python)
# and from srun: SLURM_STEP_NUM_NODES (nodes of this site: torchrun --nnodes), SLURM_NODEID within the
# step is not needed (the c10d rendezvous numbers the nodes), SLURM_STEP_NODELIST (its first node hosts the
# site's rendezvous when a site has several nodes).
set -euo pipefail

role=${1:?usage: launch.sh lighthouse | site M}
PYTHON=${PYTHON:-python}
CONFIG=${HSDP_CONFIG:-configs/tiny.yaml}
read -r -a SETS <<<"${HSDP_SET:-}"
ARGS=(--config "$CONFIG")
for s in "${SETS[@]}"; do ARGS+=(--set "$s"); done   # every host passes the run's same --set list
ADDR=${HSDP_ADDR:-$(hostname)}

case "$role" in
lighthouse)
    # 1. The run folder, once, before any replica starts (the config's checks, run.overwrite / run.resume,
    #    config.yaml): no replica prepares or deletes anything, so any replica may die.
    "$PYTHON" train.py "${ARGS[@]}" --prepare
    # 2. The lighthouse (torchft_lighthouse with the run's timeouts), started again at the same port whenever
    #    it dies, until srun / scancel sends SIGTERM.
    exec "$PYTHON" -m hsdp.lighthouse "${ARGS[@]}" --port "${HSDP_LIGHTHOUSE_PORT:-29510}"
    ;;
site)
    replica=${2:?usage: launch.sh site M}
    lighthouse=${HSDP_LIGHTHOUSE:?set HSDP_LIGHTHOUSE=http://HOST:PORT (the lighthouse host)}
    nnodes=${SLURM_STEP_NUM_NODES:-1}
    if [ "$nnodes" -gt 1 ]; then   # a site of several nodes: its first node hosts the rendezvous
        rdzv_host=$(scontrol show hostnames "$SLURM_STEP_NODELIST" | head -n 1)
    else
        rdzv_host=$ADDR
    fi
    is_host=0
    if [ "$rdzv_host" = "$ADDR" ] || [ "$rdzv_host" = "$(hostname)" ]; then is_host=1; fi
    # 1. Wait until the lighthouse answers: it starts once the run folder is prepared, and a replica refuses
    #    (in one line) a lighthouse it cannot reach.
    "$PYTHON" -m hsdp.lighthouse --wait "$lighthouse" --timeout-s 600
    # 2. This site's replica: one torchrun world of its own (--nnodes: the site's nodes), restarted by torchrun
    #    when it fails (it heals from a live replica at its next sync); the replicas meet at the lighthouse.
    #    --local-addr: the address torchft advertises to the other sites for the sync group's store.
    exec "$PYTHON" -m torch.distributed.run \
        --nnodes "$nnodes" --nproc-per-node "${HSDP_NPROC:-1}" --max-restarts "${HSDP_MAX_RESTARTS:-3}" \
        --rdzv-backend c10d --rdzv-endpoint "$rdzv_host:${HSDP_RDZV_PORT:-29400}" \
        --rdzv-id "hsdp-site$replica" --rdzv-conf "is_host=$is_host" --local-addr "$ADDR" \
        --monitor-interval 0.5 \
        train.py "${ARGS[@]}" --set "elastic.replica=$replica" --set "elastic.lighthouse=$lighthouse"
    ;;
*)
    echo "launch.sh: unknown role '$role' (lighthouse | site M)" >&2
    exit 2
    ;;
esac
