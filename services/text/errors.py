"""Errors the engine raises for bad input; each names the offending parameter."""


# OpenAI's code for a prompt (with its max_tokens) that does not fit the model's context.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class InvalidRequestError(ValueError):
    """A request the engine refuses; nothing of it was admitted."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class ModelLoadError(RuntimeError):
    """A model directory the engine cannot serve (unknown architecture, missing weights...)."""
