"""The agent loop: ask the model (through the OpenAI chat API, stock ``openai`` client) what to do, run the tool
calls it makes, feed back the observations, until it answers without a tool call or the step limit is hit.

With ``final_answer`` (the default) the episode still ends in an answer when the model will not stop calling
tools: the last allowed step, and the step after a call repeated ``MAX_REPEATS`` times, are requested with
``tool_choice: "none"``, so the model must reply in words from what it has seen (LangChain calls this early
stopping by generation). ``AgentResult.forced_by`` records why."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from quicksilver.agent.tools import Tool

MAX_REPEATS = 3  # the same call (name + arguments) this many times ends the episode: a retry loop, not progress
REPEAT_NOTE = "\n(note: you already made this exact call; the result is the same. Answer now or try something else.)"

SYSTEM_PROMPT = (  # short: it is in every step's prompt
    "Solve the task step by step with the tools. When you know the answer, reply with it and call no tool."
)


@dataclass
class ToolCallRecord:
    id: str
    name: str
    arguments: str
    observation: str
    seconds: float


@dataclass
class AgentStep:
    number: int
    thought: str  # the assistant's text that came with (or instead of) the tool calls
    tool_calls: list[ToolCallRecord]
    model_seconds: float
    forwards: int | None  # the server's diffusion_stats, when it reports them
    finish_reason: str

    @property
    def seconds(self) -> float:
        return self.model_seconds + sum(c.seconds for c in self.tool_calls)


@dataclass
class AgentResult:
    task: str
    answer: str | None
    stopped_because: str  # answer | step_limit | repeated_calls | context_full
    forced_by: str | None = None  # the answer was asked for without tools: step_limit | repeated_calls
    steps: list[AgentStep] = field(default_factory=list)
    total_seconds: float = 0.0
    sources: list[dict] = field(default_factory=list)

    @property
    def forwards(self) -> int | None:
        counts = [s.forwards for s in self.steps]
        return None if any(c is None for c in counts) else sum(counts)  # type: ignore[arg-type]

    @property
    def mean_step_seconds(self) -> float:
        return self.total_seconds / max(1, len(self.steps))

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(forwards=self.forwards, mean_step_seconds=self.mean_step_seconds)
        return d


def _canonical(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def _forwards(response: Any) -> int | None:
    extra = getattr(response, "model_extra", None) or {}
    stats = extra.get("diffusion_stats")
    if not stats:
        return None
    return sum(int(s.get("forwards", 0)) for s in stats if isinstance(s, dict))


def run_agent(
    client: Any,
    model: str,
    task: str,
    tools: list[Tool],
    max_steps: int = 8,
    system: str | None = SYSTEM_PROMPT,
    first_tool_choice: str | dict = "auto",
    max_tokens: int | None = 256,
    temperature: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    on_step: Callable[[AgentStep], None] | None = None,
    final_answer: bool = True,
) -> AgentResult:
    """Run one episode. ``first_tool_choice`` applies to the first request only (e.g. force a search first).
    ``final_answer``: see the module docstring."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be at least 1, got {max_steps}")
    by_name = {t.name: t for t in tools}
    messages: list[dict[str, Any]] = ([{"role": "system", "content": system}] if system else [])
    messages.append({"role": "user", "content": task})
    result = AgentResult(task, None, "step_limit")
    started = time.perf_counter()
    seen: dict[tuple[str, str], int] = {}  # (name, canonical arguments) -> times called
    forcing: str | None = None  # why this step must answer in words
    for number in range(1, max_steps + 1):
        request: dict[str, Any] = {"model": model, "messages": messages}
        if final_answer and forcing is None and number == max_steps and number > 1:
            forcing = "step_limit"
        if tools:
            request["tools"] = [t.spec() for t in tools]
            request["tool_choice"] = "none" if forcing else first_tool_choice if number == 1 else "auto"
        if max_tokens is not None:
            request["max_tokens"] = max_tokens
        for name, value in (("temperature", temperature), ("presence_penalty", presence_penalty),
                            ("frequency_penalty", frequency_penalty)):
            if value is not None:
                request[name] = value
        t0 = time.perf_counter()
        try:
            response = client.chat.completions.create(**request)
        except Exception as exc:  # the conversation outgrew the model's context: end the episode, keep its steps
            if getattr(exc, "status_code", None) != 400 or "context length" not in str(exc) or not result.steps:
                raise  # at the first step there is no episode to keep: the task or max_tokens cannot fit
            result.stopped_because = "context_full"
            break
        model_seconds = time.perf_counter() - t0
        choice = response.choices[0]
        message = choice.message
        calls = list(message.tool_calls or [])
        assistant: dict[str, Any] = {"role": "assistant", "content": message.content}
        if calls:
            assistant["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": c.function.arguments}}
                for c in calls
            ]
        messages.append(assistant)
        records = []
        for call in calls:
            t1 = time.perf_counter()
            tool = by_name.get(call.function.name)
            if tool is None:
                observation = f"error: unknown tool {call.function.name!r}; available: {', '.join(by_name)}"
            else:
                observation = tool(call.function.arguments or "{}")
            key = (call.function.name, _canonical(call.function.arguments or "{}"))
            seen[key] = seen.get(key, 0) + 1
            if seen[key] > 1:
                observation += REPEAT_NOTE
            records.append(ToolCallRecord(call.id, call.function.name, call.function.arguments or "", observation,
                                          time.perf_counter() - t1))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
        step = AgentStep(number, message.content or "", records, model_seconds, _forwards(response),
                         choice.finish_reason or "")
        result.steps.append(step)
        if on_step is not None:
            on_step(step)
        if not calls:
            result.answer = message.content or ""
            result.stopped_because = "answer"
            result.forced_by = forcing
            break
        if forcing is not None:  # the server called a tool all the same: nothing more to ask
            result.stopped_because = forcing
            break
        if max(seen.values()) >= MAX_REPEATS:
            if final_answer and number < max_steps:
                forcing = "repeated_calls"
                continue
            result.stopped_because = "repeated_calls"
            break
    result.total_seconds = time.perf_counter() - started
    for tool in tools:
        result.sources.extend(tool.sources)
    return result


def format_step(step: AgentStep) -> str:
    """Human-readable lines for one step: thought, tool calls and observations."""
    head = f"step {step.number}  ({step.model_seconds:.2f} s model"
    head += f", {step.forwards} forwards)" if step.forwards is not None else ")"
    lines = [head]
    if step.thought.strip():
        lines.append(("answer: " if not step.tool_calls else "thought: ") + step.thought.strip())
    for c in step.tool_calls:
        try:
            args = json.dumps(json.loads(c.arguments), ensure_ascii=False)
        except ValueError:
            args = c.arguments
        lines.append(f"tool call: {c.name}({args})")
        obs = c.observation if len(c.observation) <= 600 else c.observation[:600] + " ..."
        lines.append("observation: " + obs.replace("\n", "\n             "))
    if not step.tool_calls and not step.thought.strip():
        lines.append("answer: (empty)")
    return "\n".join(lines)
