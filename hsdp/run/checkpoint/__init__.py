"""Checkpoints as one component: the on-disk layout, the key layout, save/load, integrity and export
(docs/design.md §12.1). Engines and the sync policy hand it their state; they never name a key.

    find.py       where checkpoints are: checkpoints/step_N, an elastic replica's home, what run.resume names
    keys.py       the DCP key layout of an engine's `EngineState` (the one place keys are named)
    validate.py   before any worker starts: complete, readable, intact, a fit for the config (choose_resume:
                  with run.resume=auto, the newest intact checkpoint; damaged newer ones are moved aside)
    integrity.py  checksums.json (SHA-256 per file) and the finite-state check
    store.py      the loop's side: `Checkpoints` (save atomically, resume), `RankExtras`, prune, publish
    export.py     one model's full params read in one process (hsdp.export, hsdp.sample)

On disk (FORMAT 1; every checkpoint written so far has this layout):

    <run_dir>/checkpoints/step_N/         the state after step N (N+1 steps done); resume starts at N+1
        .metadata, __<rank>_0.distcp       DCP: every rank's tensors and pickled extras (keys: keys.py)
        meta.json                          step, engine, mesh, replicas_identical, engine_meta {"sync": the
                                           policy state_dict's meta} (hsdp/sync/state.py)
        config.yaml                        the run's resolved config at save time
        checksums.json                     SHA-256 of every file above (integrity.py)
        .complete                          written last: only a folder with it is a checkpoint
    <run_dir>/checkpoints/.tmp_step_N/    a save in progress (renamed when every rank is done)
    <run_dir>/checkpoints/corrupt/step_N/ a damaged checkpoint run.resume=auto skipped (moved, never deleted)
    <run_dir>/replica<m>/checkpoints/...   an elastic run: each replica's own, saved in its own world

The names below are the component's interface for the rest of the project.
"""

from hsdp.run.checkpoint.find import (
    CHECKPOINTS,
    COMPLETE,
    FORMAT,
    checkpoints_dir,
    complete_checkpoints,
    elastic_resume_note,
    latest_checkpoint,
    move_aside,
    remove_failed_saves,
    replica_home,
    resolve_resume,
    step_of,
)
from hsdp.run.checkpoint.store import (
    Checkpoints,
    Part,
    Progress,
    disk_full,
    free_bytes,
    prune,
    save_failure,
    state_bytes,
)
from hsdp.run.checkpoint.validate import (
    CorruptCheckpoint,
    ResumePlan,
    check_resume,
    choose_resume,
    read_dcp_metadata,
    read_meta,
    read_saved_config,
    validate_checkpoint,
    verify_files,
)

__all__ = [
    "CHECKPOINTS",
    "COMPLETE",
    "FORMAT",
    "Checkpoints",
    "CorruptCheckpoint",
    "Part",
    "Progress",
    "ResumePlan",
    "check_resume",
    "choose_resume",
    "checkpoints_dir",
    "complete_checkpoints",
    "disk_full",
    "elastic_resume_note",
    "free_bytes",
    "latest_checkpoint",
    "move_aside",
    "prune",
    "read_dcp_metadata",
    "read_meta",
    "read_saved_config",
    "remove_failed_saves",
    "replica_home",
    "resolve_resume",
    "save_failure",
    "state_bytes",
    "step_of",
    "validate_checkpoint",
    "verify_files",
]
