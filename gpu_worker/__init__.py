"""GPU worker: runs the tokenfleet engine."""
