"""tokenfleet's inference engine: paged KV cache, continuous batching with chunked prefill, preemption.

The exports load on first use (PEP 562), so that importing one of the engine's modules does not load the
engine, and torch with it."""

from importlib import import_module

from services.text.errors import InvalidRequestError, ModelLoadError

_LAZY_EXPORTS = {
    "LLM": ".llm",
    "AsyncLLMEngine": ".async_engine",
    "CompletionOutput": ".outputs",
    "EngineConfig": ".config",
    "LLMEngine": ".llm_engine",
    "RequestOutput": ".outputs",
    "ResumedChoice": ".sequence",
    "SamplingParams": ".sampling_params",
}

__all__ = ["InvalidRequestError", "ModelLoadError", *_LAZY_EXPORTS]


def __getattr__(name: str):
    if name not in _LAZY_EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
