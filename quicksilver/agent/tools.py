"""The agent's tools. Each is a name, an OpenAI function schema, and a function ``dict -> str`` (the
observation). A tool never raises into the loop: bad arguments and failures come back as ``error: ...`` text the
model can read and react to.

- ``calculator``: arithmetic through an AST whitelist (no names, attributes or calls other than math functions).
- ``read_file`` / ``list_files``: confined to one folder (symlinks and ``..`` resolved before the check).
- ``run_python``: ``sys.executable -I`` in a temporary folder, with a timeout, memory/CPU limits, and an audit hook
  that refuses every socket operation (so no network), whatever the code does.
- ``search_documents``: the RAG index.
"""

from __future__ import annotations

import ast
import copy
import json
import math
import operator
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path

MAX_OBSERVATION_CHARS = 4000


class ToolError(ValueError):
    """A tool call the tool refuses (bad arguments, outside the folder, unsafe expression)."""


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
    fn: Callable[[dict], str]
    sources: list[dict] = field(default_factory=list)  # filled by search_documents, listed in the final answer

    def spec(self) -> dict:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def __call__(self, arguments: str | dict) -> str:
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else arguments
            if not isinstance(args, dict):
                raise ToolError("arguments must be a JSON object")
            out = self.fn(args)
        except (ToolError, ValueError, TypeError, OSError, LookupError, ArithmeticError) as exc:
            out = f"error: {exc}"
        if len(out) > MAX_OBSERVATION_CHARS:
            out = out[:MAX_OBSERVATION_CHARS] + f"\n... [{len(out) - MAX_OBSERVATION_CHARS} more characters cut]"
        return out


def _string_arg(args: dict, name: str) -> str:
    value = args.get(name)
    if not isinstance(value, str):
        raise ToolError(f"argument {name!r} must be a string")
    return value


# ----------------------------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable] = {
    name: getattr(math, name) for name in (
        "sqrt", "exp", "log", "log10", "log2", "sin", "cos", "tan", "asin", "acos", "atan", "floor", "ceil",
        "factorial", "degrees", "radians", "hypot", "gcd")
} | {"abs": abs, "round": round, "min": min, "max": max}
_CONSTANTS = {"pi": math.pi, "e": math.e, "tau": math.tau}
MAX_EXPONENT = 10_000
MAX_FACTORIAL = 1000


def evaluate(expression: str) -> int | float:
    """Evaluate arithmetic safely: numbers, + - * / // % **, parentheses, math functions and constants."""
    if len(expression) > 500:
        raise ToolError("expression longer than 500 characters")
    try:
        tree = ast.parse(expression.replace("^", "**"), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None

    def ev(node: ast.AST):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > MAX_EXPONENT or (
                    abs(left) > 1 and abs(right) * math.log10(abs(left)) > MAX_EXPONENT)):
                raise ToolError(f"result would have more than {MAX_EXPONENT} digits")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS \
                and not node.keywords:
            args = [ev(a) for a in node.args]
            if node.func.id == "factorial" and args and args[0] > MAX_FACTORIAL:
                raise ToolError(f"factorial argument larger than {MAX_FACTORIAL}")
            return _FUNCTIONS[node.func.id](*args)
        raise ToolError(f"unsupported element {ast.unparse(node)!r} (only arithmetic and math functions)")

    return ev(tree)


def _calculator(args: dict) -> str:
    value = evaluate(_string_arg(args, "expression"))
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression and return the number.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"],
                 "additionalProperties": False}, _calculator)


# ----------------------------------------------------------------------------------------------- files
def confined(root: Path, relative: str) -> Path:
    """``root / relative`` resolved; refuses anything that ends up outside root (``..``, absolute, symlinks)."""
    root = root.resolve()
    target = (root / relative).resolve()
    if target != root and not target.is_relative_to(root):
        raise ToolError(f"{relative!r} is outside the allowed folder")
    return target


# Short descriptions on purpose: every offered tool's schema is in the prompt of every step, and the shipped
# models were trained on 256-token conversations.
READ_FILE_DESCRIPTION = "Read a text file (path relative to the work folder)."
LIST_FILES_DESCRIPTION = "List the files in a folder ('.' for the top)."
PATH_SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
               "additionalProperties": False}


# read_file offers the folder's files by name when they are few and short: the server's constrained decoding then
# cannot produce a path that does not exist (small models invent plausible names, session 17). The names go into
# every step's prompt, hence the limit on their total length as well as their number.
ENUM_FILES_LIMIT = 16
ENUM_CHARS_LIMIT = 240


def folder_files(root: Path, limit: int, max_chars: int = ENUM_CHARS_LIMIT) -> list[str] | None:
    """The non-hidden files inside ``root`` (relative POSIX paths, sorted), or None as soon as there are more than
    ``limit`` or their names add up to more than ``max_chars`` characters. Links leading outside ``root``, links
    that cannot be resolved and names that are not valid UTF-8 are left out (read_file cannot be asked for them)."""
    base = root.resolve()
    found: list[str] = []
    chars = 0
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(f for f in files if not f.startswith(".")):
            path = Path(folder) / name
            try:
                rel = path.relative_to(base).as_posix()
                rel.encode("utf-8")
                if not path.resolve().is_relative_to(base) or not path.is_file():
                    continue
            except (OSError, RuntimeError, UnicodeError):  # a link loop, no permission, undecodable name
                continue
            found.append(rel)
            chars += len(rel)
            if len(found) > limit or chars > max_chars:
                return None
    return sorted(found)


def file_tools(root: str | Path, max_bytes: int = 100_000, enum_limit: int = ENUM_FILES_LIMIT) -> list[Tool]:
    """read_file and list_files confined to ``root``. When the folder holds at most ``enum_limit`` files (0: never)
    with short names (:func:`folder_files`), read_file's ``path`` is an enum of them, listed when the tools are
    built; other folders get a free path."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a folder")
    names = folder_files(root, enum_limit) if enum_limit > 0 else None
    read_schema = PATH_SCHEMA if not names else {
        **PATH_SCHEMA, "properties": {"path": {"type": "string", "enum": names}}}

    def read_file(args: dict) -> str:
        path = confined(root, _string_arg(args, "path"))
        if not path.is_file():
            raise ToolError(f"{args['path']!r} is not a file")
        data = path.read_bytes()[:max_bytes]
        if b"\x00" in data[:4096]:
            raise ToolError(f"{args['path']!r} is a binary file")
        return data.decode("utf-8", errors="replace")

    def list_files(args: dict) -> str:
        folder = confined(root, args.get("path") or ".")
        if not folder.is_dir():
            raise ToolError(f"{args.get('path')!r} is not a folder")
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith("."))
        return "\n".join(names) or "(empty folder)"

    return [
        Tool("read_file", READ_FILE_DESCRIPTION, read_schema, read_file),
        Tool("list_files", LIST_FILES_DESCRIPTION, PATH_SCHEMA, list_files),
    ]


# ----------------------------------------------------------------------------------------------- python
# Prepended to the user's code: an audit hook (cannot be removed once added) refuses sockets, so no network.
_SANDBOX_PRELUDE = """
import sys
def _qs_no_network(event, args):
    if event.startswith("socket.") and event != "socket.gethostname":
        raise PermissionError("network access is disabled in this sandbox")
sys.addaudithook(_qs_no_network)
del _qs_no_network
"""


def _limit_resources(memory_bytes: int, cpu_seconds: int) -> Callable[[], None]:
    def apply() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
        os.setsid()  # own process group, so a timeout kills grandchildren too

    return apply


def run_python(code: str, timeout: float = 10.0, memory_mb: int = 1024) -> str:
    """Run code in a fresh isolated interpreter; returns exit status, stdout and stderr (truncated)."""
    with tempfile.TemporaryDirectory(prefix="qs-agent-") as work:
        script = Path(work) / "main.py"
        script.write_text(_SANDBOX_PRELUDE + "\n" + code)
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": work, "PYTHONIOENCODING": "utf-8",
               "LANG": "C.UTF-8", "NO_PROXY": "*", "http_proxy": "http://0.0.0.0:9", "https_proxy": "http://0.0.0.0:9"}
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", str(script)], cwd=work, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=_limit_resources(memory_mb * 1024 * 1024, int(timeout) + 1),
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            return f"error: timed out after {timeout:g} s\nstdout:\n{out[-1500:]}"
    prelude_lines = _SANDBOX_PRELUDE.count("\n") + 1
    err = err.replace(str(script), "main.py")
    parts = [f"exit status {proc.returncode}"]
    if out:
        parts.append("stdout:\n" + out)
    if err:
        parts.append(f"stderr (line numbers include a {prelude_lines}-line sandbox prelude):\n" + err)
    return "\n".join(parts)


def python_tool(timeout: float = 10.0) -> Tool:
    return Tool("run_python", f"Run a Python 3 program (no network, {timeout:g} s limit) and return what it prints. "
                "Use print() to show results.",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"],
                 "additionalProperties": False},
                lambda args: run_python(_string_arg(args, "code"), timeout))


# ----------------------------------------------------------------------------------------------- search
def search_tool(index_path: str | Path, k: int = 4, torch_thread: Executor | None = None) -> Tool:
    """``k``: passages per search, and the most a call may ask for: the tool's schema says so (a constrained call
    cannot ask for more) and a larger request is cut to it, so the model cannot fill its context with passages.
    ``torch_thread``: run the search (it embeds the query) there, e.g. the model thread of a server in this
    process: with libgomp a second thread running torch code slows that server's forwards (engine.model_thread)."""
    from quicksilver.rag.chat import SEARCH_TOOL, open_index, run_search_tool

    open_index(index_path)  # fail now (missing file) rather than at the first call
    parameters = copy.deepcopy(SEARCH_TOOL["function"]["parameters"])
    parameters["properties"]["k"]["maximum"] = k
    tool = Tool("search_documents", SEARCH_TOOL["function"]["description"], parameters, lambda args: "")

    # a call made on that (one-thread) executor itself runs inline: waiting for it there would never return
    worker_ident = torch_thread.submit(threading.get_ident).result() if torch_thread is not None else None

    def search(args: dict) -> str:
        if torch_thread is None or threading.get_ident() == worker_ident:
            text, sources = run_search_tool(index_path, args, default_k=k, max_k=k)
        else:
            text, sources = torch_thread.submit(run_search_tool, index_path, args, default_k=k, max_k=k).result()
        seen = {(s["path"], s["chunk"]) for s in tool.sources}
        tool.sources.extend(s for s in sources if (s["path"], s["chunk"]) not in seen)
        return text

    tool.fn = search
    return tool


TOOL_NAMES = ("search_documents", "calculator", "read_file", "list_files", "run_python")


def build_tools(names: list[str], root: str | Path | None = None, index_path: str | Path | None = None,
                python_timeout: float = 10.0, search_k: int = 4, torch_thread: Executor | None = None) -> list[Tool]:
    """Tools by name; file tools need ``root`` and search needs ``index_path`` (``torch_thread``: see
    :func:`search_tool`)."""
    unknown = [n for n in names if n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f"unknown tool(s) {', '.join(unknown)}; choose from {', '.join(TOOL_NAMES)}")
    tools: list[Tool] = []
    for name in dict.fromkeys(names):
        if name == "calculator":
            tools.append(calculator_tool())
        elif name == "run_python":
            tools.append(python_tool(python_timeout))
        elif name == "search_documents":
            if index_path is None:
                raise ValueError("the search_documents tool needs --index FILE")
            tools.append(search_tool(index_path, k=search_k, torch_thread=torch_thread))
        elif name in ("read_file", "list_files"):
            if root is None:
                raise ValueError(f"the {name} tool needs --root FOLDER")
            tools.extend(t for t in file_tools(root) if t.name == name)
    return tools
