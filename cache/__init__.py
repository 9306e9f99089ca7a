"""tokenfleet cache service (response caches, prefix directory); built in the prefix-caching issue."""
