"""The team's GPU quota: the pools and who holds and waits (pools.py), a run's turn for the GPUs (hold.py)."""
