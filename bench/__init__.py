"""Reproducible benchmarks of tokenfleet against its peers."""
