"""Request models of the OpenAI-compatible API (pydantic, strict about unknown fields).

Documented OpenAI fields that a stock client may send but that we do not implement are accepted and
ignored when they are at their neutral value (e.g. ``user``, ``metadata``, ``parallel_tool_calls``); a value we
cannot honour (``logprobs`` on a bidirectional model) is a 400 from the server, and a
field OpenAI does not define is a 400 "unknown field", except the few that the ``openai`` client itself puts on a
message it returned (``annotations``, ``parsed``, a call's ``index`` and ``parsed_arguments``), which come back
when a client appends that message to its conversation. Extensions: ``diffusing`` (canvas snapshots while
streaming), ``retrieval`` (RAG over the server's index), ``top_k``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from quicksilver.sampling import seed_error
from quicksilver.structured.tools import tool_name_error

REASONING_EFFORTS = ("none", "minimal", "instant", "low", "medium", "high", "xhigh")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where (``messages[0].content``) a string in parsed JSON holds a lone UTF-16 surrogate (a ``\\ud800``
    escape without its pair): such text cannot be encoded as UTF-8, so no tokenizer can read it. None if none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")  # the path goes into the reply
            here = f"{path}.{name}" if path else name
            where = lone_surrogate_at(key, here) or lone_surrogate_at(item, here)
            if where:
                return where
    elif isinstance(value, list):
        for i, item in enumerate(value):
            where = lone_surrogate_at(item, f"{path}[{i}]")
            if where:
                return where
    return None


def check_unicode(body: Any) -> None:
    """Raise ProtocolError (param = where) for text that is not valid Unicode."""
    where = lone_surrogate_at(body)
    if where is not None:
        raise ProtocolError(f"{where}: the text is not valid Unicode (a lone UTF-16 surrogate escape such as "
                            "\\ud800 without its pair)", where)


class FunctionCall(Strict):
    name: str
    arguments: str = "{}"
    # the openai client's parse/stream helpers add this to the calls they return; a client that appends the
    # returned message to its conversation (the documented agent loop) sends it back: accepted and ignored
    parsed_arguments: Any = None


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # on calls accumulated by the openai client's stream helper; ignored


class ContentPart(BaseModel):
    # image/audio parts are valid OpenAI input that we cannot read; the server rejects them with a 400
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    function_call: dict[str, Any] | None = None  # deprecated; accepted and ignored
    audio: dict[str, Any] | None = None  # accepted and ignored
    # in every assistant message we return, so in the conversation a client sends back: accepted and ignored
    annotations: list[Any] | None = None
    parsed: Any = None  # the openai client's parse/stream helpers add it to the message they return; ignored


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if error := tool_name_error(v):  # the rule `quicksilver chat --tools` applies too
            raise ValueError(error)
        return v


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchemaFormat(Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # newer clients send it; we never add obfuscation


class Retrieval(Strict):
    """``"retrieval"`` extension. ``mode="prompt"``: the passages for the last user message go into the system
    turn before decoding. ``mode="tool"``: the model sees the built-in ``search_documents`` tool and the server runs
    it (``k`` = passages per search when the call does not say), at most ``max_search_rounds`` times."""

    k: int = Field(default=5, ge=1, le=50)
    mode: Literal["prompt", "tool"] = "prompt"
    max_search_rounds: int | None = Field(default=None, ge=1, le=4)

    @model_validator(mode="after")
    def _rounds_need_tool_mode(self) -> Retrieval:
        if self.max_search_rounds is not None and self.mode != "tool":
            raise ValueError('max_search_rounds applies only to mode "tool"')
        return self

    @property
    def search_rounds(self) -> int:
        return self.max_search_rounds if self.max_search_rounds is not None else 2


StopField = str | list[str] | None


def _check_stop(v: StopField) -> StopField:
    if isinstance(v, list):
        if len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in v):
            raise ValueError("stop sequences must be non-empty")
    elif v == "":
        raise ValueError("stop sequences must be non-empty")
    return v


class SamplingFields(Strict):
    """Fields shared by chat and legacy completions."""

    model: str
    # numbers and flags are typed as OpenAI types them: "2", 2.5 or true is no n, "yes" no stream (no coercion)
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: StrictFloat | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)  # 0 means greedy
    top_k: StrictInt | None = Field(default=None, ge=0)  # extension (vLLM-style)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stop: StopField = None
    seed: StrictInt | None = None  # a signed 64-bit integer (SamplingParams' rule)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: StrictFloat | None = Field(default=None, ge=-2, le=2, allow_inf_nan=False)
    # token id (a string) -> bias
    logit_bias: dict[str, Annotated[StrictFloat, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    metadata: dict[str, str] | None = None
    store: StrictBool | None = None
    service_tier: str | None = None

    _stop = field_validator("stop")(classmethod(lambda cls, v: _check_stop(v)))

    @field_validator("seed")
    @classmethod
    def _seed(cls, v: int | None) -> int | None:
        if v is not None and (error := seed_error(v)):
            raise ValueError(error)
        return v

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        check_unicode(data)  # before the tokenizer sees it: it would fail with a TypeError (a 500)
        return data


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    reasoning_effort: str | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # OpenAI's deprecated forms of tools/tool_choice: named, so the error says what to send instead
    functions: list[Any] | None = None
    function_call: Any = None
    # extensions
    diffusing: StrictBool | None = None
    retrieval: Retrieval | None = None

    @field_validator("functions", "function_call")
    @classmethod
    def _deprecated(cls, v: Any, info: Any) -> Any:
        if v is not None:
            instead = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"the deprecated {info.field_name!r} is not supported; send {instead!r} instead")
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and set(v) != {"text"}:  # ["text"] is the neutral value; audio output we cannot give
            raise ValueError(f'only ["text"] is supported, got {json.dumps(v)}')
        return v

    @field_validator("prediction")
    @classmethod
    def _no_prediction(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:  # null is the neutral value
            raise ValueError("predicted outputs are not supported; omit 'prediction' or send null")
        return v

    @field_validator("web_search_options")
    @classmethod
    def _no_web_search(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:  # any object asks for a web search, which an offline server cannot make
            raise ValueError("web search is not supported (the server is offline); omit 'web_search_options' or send "
                             "null ('retrieval' searches the server's own document index)")
        return v

    @field_validator("verbosity")
    @classmethod
    def _default_verbosity(cls, v: str | None) -> str | None:
        if v not in (None, "medium"):  # medium is the neutral value: the model's answers are as long as they are
            raise ValueError(f"only 'medium' is supported, got {v!r}; use max_tokens to bound an answer's length")
        return v

    @field_validator("reasoning_effort")
    @classmethod
    def _effort(cls, v: str | None) -> str | None:
        if v is not None and v not in REASONING_EFFORTS:
            raise ValueError(f"must be one of {', '.join(REASONING_EFFORTS)}")
        return v


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids: true or 1.0 is no id
    suffix: str | None = None
    echo: StrictBool | None = False
    best_of: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    # OpenAI's default for legacy completions; 0 with echo scores the prompt alone (logprobs), generating nothing
    max_tokens: StrictInt | None = Field(default=16, ge=0)


class FimCompletionRequest(CompletionRequest):
    """Mercury's ``POST /v1/fim/completions``: ``prompt`` is the code before the gap, ``suffix`` (required, may be
    empty) the code after it; the answer is the middle. Without ``max_tokens`` the model's default budget applies
    (the legacy endpoint's 16 would cut most fills)."""

    suffix: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)


# -- conversions between OpenAI shapes and our chat template -------------------------------------------
class ProtocolError(ValueError):
    """A request that is well-formed JSON but cannot be served as asked (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def message_text(msg: ChatMessage, index: int) -> str:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content or ""
    texts = []
    for j, part in enumerate(msg.content):
        if part.type not in ("text", "input_text"):
            raise ProtocolError(
                f"content part type {part.type!r} is not supported (text only)", f"messages[{index}].content[{j}]"
            )
        if part.text is None:
            raise ProtocolError(f"a {part.type!r} content part needs a string 'text'",
                                f"messages[{index}].content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the dicts our chat template renders (developer -> system, function -> tool;
    assistant tool calls as [{"name", "arguments": object}])."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        item: dict[str, Any] = {"role": role, "content": message_text(m, i)}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments or "{}")
                except json.JSONDecodeError:
                    raise ProtocolError(
                        "tool call arguments must be a JSON string",
                        f"messages[{i}].tool_calls[{j}].function.arguments",
                    ) from None
                calls.append({"name": call.function.name, "arguments": args})
            item["tool_calls"] = calls
        out.append(item)
    return out


def check_schema(schema: dict[str, Any], param: str) -> None:
    """Reject schemas that are not valid JSON Schema (400, never silently unconstrained output)."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise ProtocolError(f"invalid JSON schema: {exc.message}", param) from None
