"""tokenfleet gateway (OpenAI-compatible HTTP front door); built in the service-pipeline issue."""
