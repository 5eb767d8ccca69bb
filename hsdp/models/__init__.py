"""The models: the GPT and llama units (gpt.py), the inner optimizer and its LR schedule (optim.py), Hugging Face
config and tensor names (hf.py), warm start from an exported model (init_from.py)."""
