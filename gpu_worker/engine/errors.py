"""Errors the engine raises for bad input; each names the offending parameter."""


class InvalidRequestError(ValueError):
    """A request the engine refuses; nothing of it was admitted."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(RuntimeError):
    """A model directory the engine cannot serve (unknown architecture, missing weights...)."""
