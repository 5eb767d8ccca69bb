"""Print the config reference table (docs/config.md) from the dataclasses in hsdp/config/schema.py.

    python scripts/config_table.py            # print the table
    python scripts/config_table.py --write    # replace the table between docs/config.md's markers

One row per key, `section.key | default | meaning`, in the order of `Config`'s
sections and their fields. The default is the dataclass default. The meaning
is the key's entry in MEANINGS below if it has one, else the comment after the
field in hsdp/config/schema.py (or the comment lines right above it); a key with
neither is an error, so a new key cannot be added without a description. For keys with a fixed set of values
(`hsdp.config.schema.CHOICES`) the choices are appended unless the meaning already
names them all. tests/test_readme.py checks that docs/config.md holds exactly
this output (the README links to it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "config.md"  # the page that holds the table between START and END
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hsdp.config.schema import CHOICES, Config  # noqa: E402

START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"

# Meanings for keys whose field has no comment, or whose comment does not read on its own in a table.
MEANINGS: dict[str, str] = {
    "run.name": "run folder name: outputs go to `<out_dir>/<name>/`",
    "run.out_dir": "parent folder of run folders",
    "run.seed": "model init and data order",
    "run.steps": "optimizer steps",
    "run.log_every": "steps between metric records (evals and the last step are always logged)",
    "run.eval_every": "steps between evals (0 = only at the end)",
    "run.eval_batches": "val batches per rank at each eval",
    "run.slowdown": (
        "fault injection (benchmarks, tests): after each trained step the rank sleeps (slowdown − 1) × that "
        "step's time, so it runs slowdown× slower; >= 1"
    ),
    "elastic.round_timeout_s": (
        "straggler bound (s): a param-sync round counts the replicas that arrive within this of the first; a "
        "slower one cuts its period short to arrive in time (0 = off: every round waits for everyone)"
    ),
    "model.vocab_size": (
        "vocabulary size (>= 256 for byte-level data; null: the size of the tokenizer.json "
        "beside data.path, tokens only)"
    ),
    "model.seq_len": "tokens per sequence (context length)",
    "model.n_layer": "transformer blocks",
    "model.n_head": "attention heads (must divide d_model)",
    "model.d_model": "model width",
    "model.bias": "biases in linear layers and LayerNorms (with model.arch=llama the default is false)",
    "data.source": (
        "`stdlib` (the interpreter's own .py files, byte-level), `text` (file or glob, byte-level), "
        "`tokens` (llm.c shards or headerless uint16 `.bin`, memmapped), `synthetic`"
    ),
    "data.val_fraction": (
        "share held out for validation: whole files (stdlib, a text glob), else the tail "
        "(one text file; tokens without a val.bin)"
    ),
    "mesh.engine": "`hsdp` (this project), `fsdp2` (PyTorch `fully_shard` per unit on the same 2-D mesh), `ddp`",
    "optim.lr": "peak learning rate (linear warmup, then cosine decay to min_lr at the last step)",
    "optim.min_lr": "learning rate at the last step",
    "optim.weight_decay": "decoupled weight decay (none on biases, norms and embeddings)",
    "optim.beta1": "AdamW β1",
    "optim.beta2": "AdamW β2",
    "optim.eps": "AdamW ε",
    "optim.momentum": "SGD momentum (sgd only)",
    "optim.grad_clip": "global-norm gradient clipping threshold (0 = off)",
    "optim.grad_accum": "micro-steps per optimizer step",
    "sync.warmup_steps": (
        "steps of exact HSDP (grads averaged across replicas) before periodic param sync; null = the whole run"
    ),
    "sync.outer_lr": "outer learning rate η (null: 0.7 for diloco; average is η = 1 and may not set it)",
    "sync.outer_momentum": "outer momentum μ (null: 0.9 for diloco; average is μ = 0 and may not set it)",
    "sync.nesterov": "Nesterov outer momentum (diloco)",
    "sync.fragments": "P: streaming fragments (units round-robin, synced every/P steps apart; must divide every)",
    "sync.quantize": "`int8` / `int4` / `int2`: Δ (or its top-k values) sent as 8/4/2-bit values + one fp32 scale "
    "(int2: a table of two fp32 levels) per block",
    "wandb.project": "wandb project",
    "wandb.entity": "wandb entity (null: the account's default)",
}


def sections() -> list[tuple[str, type]]:
    """(section name, dataclass) for each section of `Config`, in order."""
    return [(f.name, type(f.default_factory())) for f in dataclasses.fields(Config)]  # type: ignore[misc]


def keys() -> list[str]:
    """Every `section.key` of the config, in table order."""
    return [f"{name}.{f.name}" for name, cls in sections() for f in dataclasses.fields(cls)]


def field_comments(cls: type) -> dict[str, str]:
    """Field name → its comment in the class source: the one on its line, else the comment lines right
    above it (for a field whose comment does not fit beside it); fields with neither are left out."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline)
        if tok.type == tokenize.COMMENT
    }

    def own_line(n: int) -> bool:  # line n (1-based) holds nothing but a comment
        return n in comments and lines[n - 1].lstrip().startswith("#")

    out = {}
    for node in ast.walk(ast.parse(src)):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.lineno in comments and not own_line(node.lineno):
            out[node.target.id] = comments[node.lineno]
            continue
        above = node.lineno - 1
        while own_line(above):
            above -= 1
        if above < node.lineno - 1:
            out[node.target.id] = " ".join(comments[n] for n in range(above + 1, node.lineno))
    return out


def format_default(value: Any) -> str:
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    else:
        text = repr(value)
    return f"`{text}`"


def meaning(key: str, comments: dict[str, str]) -> str:
    name = key.split(".", 1)[1]
    text = MEANINGS.get(key) or comments.get(name)
    if not text:
        raise ValueError(
            f"config key {key} has no meaning: add a comment to its field in hsdp/config/schema.py "
            f"or an entry to MEANINGS in scripts/config_table.py"
        )
    choices = CHOICES.get(key)
    if choices and not all(c in text for c in choices):
        text += f" (one of: {', '.join(choices)})"
    return text.replace("|", "\\|")


def table() -> str:
    """The markdown table, one row per key."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for section, cls in sections():
        comments = field_comments(cls)
        defaults = cls()
        for f in dataclasses.fields(cls):
            key = f"{section}.{f.name}"
            rows.append(f"| `{key}` | {format_default(getattr(defaults, f.name))} | {meaning(key, comments)} |")
    return "\n".join(rows) + "\n"


def table_block(page: str) -> str:
    """The text between the page's config-table markers (exactly one pair)."""
    if page.count(START) != 1 or page.count(END) != 1:
        raise ValueError(f"the config page must contain {START} and {END} once each")
    return page.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_page(path: Path = PAGE) -> bool:
    """Replace the table between the markers; True if the file changed."""
    text = path.read_text()
    table_block(text)  # checks the markers
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{table()}{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help=f"update {PAGE.relative_to(ROOT)} in place instead of printing")
    args = p.parse_args(argv)
    if args.write:
        changed = write_page(PAGE)
        name = PAGE.relative_to(ROOT)
        print(f"{name} updated" if changed else f"{name} already up to date")
    else:
        sys.stdout.write(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
