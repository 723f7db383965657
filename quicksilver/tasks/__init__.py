"""Verifiable task suite: generators with exact programmatic verifiers, for training data and held-out eval.

``TASKS`` maps a task name to its :class:`~quicksilver.tasks.base.Task`. Use ``generate(rng, split)`` with
split "train" for training data and "eval" for the held-out suite (different seeds AND held-out phrasings),
and ``verify(example, output_text)`` to grade a model's raw output (special tokens kept).
"""

from __future__ import annotations

from quicksilver.tasks.agent_open import AgentOpen
from quicksilver.tasks.agent_steps import AgentStep
from quicksilver.tasks.arithmetic import Arithmetic, WordProblem
from quicksilver.tasks.base import Example, Split, Task, clean_output, render, render_prompt
from quicksilver.tasks.code_synthesis import CodeSynthesis
from quicksilver.tasks.infilling import Infilling
from quicksilver.tasks.json_extraction import JsonExtraction
from quicksilver.tasks.json_varied import JsonVaried
from quicksilver.tasks.planning import Countdown, Sudoku
from quicksilver.tasks.recall import Recall
from quicksilver.tasks.retrieval import RetrievalNear, RetrievalQA
from quicksilver.tasks.tool_use import ToolAnswer, ToolCall
from quicksilver.tasks.tool_varied import Sums, ToolVaried

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        ToolCall(),
        ToolAnswer(),
        ToolVaried(),
        Sums(),
        JsonExtraction(),
        JsonVaried(),
        Arithmetic(),
        WordProblem(),
        Countdown(),
        Sudoku(),
        RetrievalQA(),
        RetrievalNear(),
        CodeSynthesis(),
        Infilling(),
        AgentStep(),
        AgentOpen(),
        Recall(),
    )
}
# the held-out eval suite (and the bench's prompts): every task except the training drills
SUITE: tuple[str, ...] = tuple(name for name, task in TASKS.items() if task.in_suite)


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise LookupError(f"unknown task {name!r} (known: {', '.join(TASKS)})") from None


__all__ = ["SUITE", "TASKS", "Example", "Split", "Task", "clean_output", "get_task", "render", "render_prompt"]
