"""What every room shares: atomic file writes (atomic.py, no torch) and the units' shard layout (layout.py)."""
