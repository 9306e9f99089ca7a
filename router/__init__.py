"""tokenfleet router (tier and worker choice); built in the service-pipeline issue."""
