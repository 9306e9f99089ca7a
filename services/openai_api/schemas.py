"""OpenAI request bodies, validated: a bad field becomes a 400 naming it (`param`), as OpenAI answers."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from services.base import protocol as p

# Fields of OpenAI's API this gateway does not implement: refused by name rather than ignored.
UNSUPPORTED = {"tools", "tool_choice", "functions", "function_call", "response_format", "logit_bias",
               "parallel_tool_calls", "audio", "modalities", "prediction", "web_search_options", "suffix",
               "best_of", "echo", "reasoning_effort", "service_tier", "store", "metadata"}
MAX_N = 16
MAX_MESSAGES = 2048
MAX_STOP_CHARS = 1024
MAX_ID_CHARS = 256  # model names, `user`, `cache_salt`
INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1

# The OpenAPI document's view of what the validators below accept (WithJsonSchema documents; it validates nothing).
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"const": "text"}, "text": {"type": "string"}}}}
_STOPS = {"anyOf": [{"type": "string", "minLength": 1, "maxLength": MAX_STOP_CHARS},
                    {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1,
                                                               "maxLength": MAX_STOP_CHARS}}]}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX}}
_PROMPT = {"anyOf": [{"type": "string", "minLength": 1}, _TOKEN_IDS,  # or either one alone in a list (a batch of one)
                     {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                     {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS}]}


def _whole(number):
    return int(number) if isinstance(number, float) and number.is_integer() else number


# Request fields are strict, as OpenAI's: no "5" for 5, no 1 or "yes" for true (an int still is a float). But JSON's
# 5.0 is the integer 5, as JSON Schema reads it: so does the OpenAPI document, and Schemathesis sends such integers.
Integer = Annotated[int, BeforeValidator(_whole)]
OptionalInteger = Annotated[int | None, BeforeValidator(_whole)]  # not `Integer | None`: its JSON schema drops bounds


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"anyOf": [  # as `_content`
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["role", "tool_calls"], "properties": {"role": {"const": "assistant"},
                                                             "tool_calls": {"type": "array", "minItems": 1}}},
        {"required": ["role", "function_call"], "properties": {"role": {"const": "assistant"},
                                                                "function_call": {"type": "object",
                                                                                  "minProperties": 1}}}]})
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # An assistant's calls: taken, not rendered (the chat template gets role and content); declared before
    # `content`, whose validator reads them.
    tool_calls: list[dict[str, Any]] | None = None
    function_call: dict[str, Any] | None = None  # the legacy form of one tool call
    content: str | Annotated[list[dict[str, Any]], WithJsonSchema(_TEXT_PARTS)] | None = Field(
        default=None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content(cls, content, info: ValidationInfo):
        if content is None and not (info.data.get("role") == "assistant"
                                    and (info.data.get("tool_calls") or info.data.get("function_call"))):
            raise ValueError("expected a string or a list of text parts (null only in an assistant message "
                             "with tool_calls)")
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise ValueError("only text content parts are supported")
            if any(not isinstance(part.get("text"), str) for part in content):
                raise ValueError("a text part's 'text' must be a string")
        return content

    def as_template_input(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        return {"role": self.role, "content": content or ""}


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)
    model: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    max_tokens: OptionalInteger = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: Integer = Field(default=1, ge=1, le=MAX_N)
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOPS)] = None
    seed: OptionalInteger = Field(default=None, ge=-INT64_MAX - 1, le=INT64_MAX)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extensions, for users who come from it
    top_k: Integer = Field(default=-1, ge=-1, le=INT32_MAX)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    # tokenfleet's: the response caches for this request (else the API key's, else the deployment's default)
    cache: p.CacheMode | None = None
    sla: str | None = Field(default=None, min_length=1, max_length=32)  # an SLA class; else the API key's

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be 1 to {MAX_STOP_CHARS} characters")
        return stops

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> p.SamplingOptions:
        return p.SamplingOptions(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, seed=self.seed, stop=self.stop or [],
            ignore_eos=self.ignore_eos, logprobs=logprobs)

    def engine_salt(self, prefix_scope: str) -> str:
        """The prefix cache's salt: the key's scope, then the client's own `cache_salt`, which narrows sharing
        within the scope and can never reach another tenant's prefixes (the cached-tokens count and the
        time to first token would tell a prober what another tenant's prompts begin with)."""
        return json.dumps([prefix_scope, self.cache_salt])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Common):
    model_config = ConfigDict(json_schema_extra={  # as `_top_logprobs_need_logprobs`
        "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
        "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}})
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: OptionalInteger = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: OptionalInteger = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    def to_message(self, request_id: str, api_key_name: str, prefix_scope: str) -> p.GenerateRequest:
        """`prefix_scope`: whose cached prefixes the request may reuse (`services.tenancy.auth.prefix_scope`)."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return p.GenerateRequest(request_id=request_id, kind="chat", model=self.model,
                                 messages=[m.as_template_input() for m in self.messages],
                                 sampling=self.sampling(max_tokens, logprobs), api_key_name=api_key_name,
                                 user=self.user, cache_salt=self.engine_salt(prefix_scope))


class CompletionRequest(_Common):
    prompt: Annotated[str | list[Annotated[Integer, Field(ge=0, le=INT32_MAX)]], WithJsonSchema(_PROMPT)] = Field(
        min_length=1)
    logprobs: OptionalInteger = Field(default=None, ge=0, le=20)

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            return prompt[0]  # a batch of one
        if isinstance(prompt, list) and prompt and not all(_integral(t) for t in prompt):
            raise ValueError("one prompt per request: a string or a list of token ids")
        return prompt

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs is not None

    def to_message(self, request_id: str, api_key_name: str, prefix_scope: str) -> p.GenerateRequest:
        """As `ChatCompletionRequest.to_message`."""
        return p.GenerateRequest(request_id=request_id, kind="completion", model=self.model, prompt=self.prompt,
                                 sampling=self.sampling(self.max_tokens, self.logprobs), api_key_name=api_key_name,
                                 user=self.user, cache_salt=self.engine_salt(prefix_scope))


def _integral(token) -> bool:
    """A token id: an int, or a float with no fraction (JSON's 5.0 is an integer, as for every other field)."""
    return isinstance(token, int) or isinstance(token, float) and token.is_integer()


CACHE_HEADER = "x-tokenfleet-cache"  # a request's cache mode (as the body's `cache`); a response's cache answer


def cache_mode(body: p.CacheMode | None, header: str | None, key_default: p.CacheMode | None,
               default: p.CacheMode) -> p.CacheMode:
    """The body's choice, else the header's, else the API key's, else the deployment's."""
    if header is not None and header not in get_args(p.CacheMode):
        raise RequestError(p.ErrorBody(message=f"{CACHE_HEADER} must be one of {', '.join(get_args(p.CacheMode))}",
                                       param=CACHE_HEADER))
    return body or header or key_default or default


def parse(cls: type[_Common], body: Any) -> _Common:
    """The validated request, or `RequestError` with OpenAI's 400 body naming the offending field."""
    if not isinstance(body, dict):
        raise RequestError(p.ErrorBody(message="the request body must be a JSON object"))
    for name in UNSUPPORTED & body.keys():
        if body[name] not in (None, [], {}) and not (name == "response_format" and body[name] == {"type": "text"}):
            raise RequestError(p.ErrorBody(message=f"'{name}' is not supported by this server", param=name,
                                           code="unsupported_parameter"))
    try:  # null means "the default", as OpenAI reads it
        return cls.model_validate({k: v for k, v in body.items() if k not in UNSUPPORTED and v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        param = param_name(first["loc"])
        message = "Unrecognized request argument supplied: " + param if first["type"] == "extra_forbidden" \
            else f"{param}: {first['msg']}"
        raise RequestError(p.ErrorBody(message=message, param=param, code="invalid_value")) from None


def param_name(path) -> str | None:
    """OpenAI's `param` for a field's location in the body (`messages.0.content`); None for the body itself."""
    return ".".join(str(part) for part in path) or None


class RequestError(Exception):
    def __init__(self, error: p.ErrorBody, headers: dict[str, str] | None = None):
        super().__init__(error.message)
        self.error = error
        self.headers = headers or {}
