"""Training data: token streams and batches (tokens.py), the llm.c shard format (shards.py, no torch), a text
corpus's files, documents and split (corpus.py, no torch). The `python -m hsdp.prepare` command is hsdp/prepare.py."""
