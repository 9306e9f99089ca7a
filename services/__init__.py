"""Shared service code: CLI, stream protocol, config, telemetry, accounting."""
