"""Experiments on the engine's parts, kept to measure later changes by: not user commands, and imported by no
bench module or service (README.md says how to run each)."""
