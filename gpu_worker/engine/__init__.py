"""tokenfleet's inference engine: paged KV cache, continuous batching with chunked prefill, preemption."""

from .async_engine import AsyncLLMEngine
from .config import EngineConfig
from .errors import InvalidRequestError, ModelLoadError
from .llm import LLM
from .llm_engine import LLMEngine
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .sequence import ResumedChoice

__all__ = [
    "LLM", "AsyncLLMEngine", "CompletionOutput", "EngineConfig", "InvalidRequestError", "LLMEngine",
    "ModelLoadError", "RequestOutput", "ResumedChoice", "SamplingParams",
]
