"""Val loss per byte of text: a BPE run next to a byte-level run (docs/results/tiny-bpe.md).

    python scripts/bpe_vs_bytes.py BPE_RUN_DIR BYTE_RUN_DIR PREPARED_DIR OUT.png

A BPE token covers several bytes, so its loss per token is not comparable with a byte-level
run's; dividing by the corpus's bytes per token (from the prepare step's record) puts both in
nats per byte of text, against the bytes of text each run has trained on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def evals(run_dir: Path) -> list[tuple[int, float]]:
    """(tokens trained, val loss) at each eval of a run."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["tokens"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]


def bytes_per_token(prepared: Path) -> float:
    """Text bytes per token over the whole prepared corpus (prepare.json's sizes and counts)."""
    record = json.loads((prepared / "prepare.json").read_text())
    text_bytes = sum(size for _path, size, _mtime in record["files"])
    tokens = sum(split["tokens"] for split in record["splits"].values())
    return text_bytes / tokens


def main(bpe: str, byte: str, prepared: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bpt = bytes_per_token(Path(prepared))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label, run, per_token_bytes in (("BPE 2048 (llama)", bpe, bpt), ("bytes (gpt)", byte, 1.0)):
        points = evals(Path(run))
        xs = [t * per_token_bytes / 1e6 for t, _ in points]
        ax.plot(xs, [v / per_token_bytes for _, v in points], "o-", label=label)
        print(f"{label}: final {points[-1][1]:.4f} nats/token = {points[-1][1] / per_token_bytes:.4f} nats/byte")
    ax.set_xlabel("text trained on, MB")
    ax.set_ylabel("val loss, nats per byte of text")
    ax.set_title(f"tiny jobs, 600 steps each (BPE: {bpt:.2f} bytes/token)", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:5])
