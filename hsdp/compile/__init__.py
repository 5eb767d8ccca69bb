"""torch.compile passes (later issue)."""
