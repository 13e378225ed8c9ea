"""A node's lifecycle: the Node context manager, the trainer thread, checkpoints, stats."""
