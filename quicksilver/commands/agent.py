"""``quicksilver agent "task"``: a tool-using loop over the OpenAI chat API.

With ``--base-url`` it talks to a running server; otherwise it starts the Quicksilver server in-process on a
free local port (same code path as ``quicksilver serve``) and talks to that with the stock ``openai`` client.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from quicksilver.commands._decode_args import add_penalty_args
from quicksilver.sampling import SamplingParams

DEFAULT_TOOLS = "calculator,run_python"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agent", help="solve a task with tools (search, calculator, files, Python) via the chat API")
    p.add_argument("task", help="the task ('-' reads standard input)")
    p.add_argument("--tools", default=None,
                   help="comma-separated: search_documents, calculator, read_file, list_files, run_python "
                        f"(default {DEFAULT_TOOLS}, plus search_documents with --index and the file tools with --root)")
    p.add_argument("--index", help="document index for search_documents")
    p.add_argument("--root", help="folder the file tools may read")
    p.add_argument("--search-k", type=int, default=4,
                   help="passages per search_documents call: the default, and the most the model may ask for")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per model turn")
    p.add_argument("--temperature", type=float)
    add_penalty_args(p)
    p.add_argument("--python-timeout", type=float, default=10.0, help="seconds per run_python call")
    p.add_argument("--first-tool", help="force this tool on the first turn (tool_choice)")
    p.add_argument("--no-final-answer", dest="final_answer", action="store_false",
                   help="end without an answer at the step limit or on a repeated call, instead of asking the model "
                        "for an answer without tools")
    p.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (default: in-process)")
    p.add_argument("--api-key", default="unused", help="API key for --base-url")
    p.add_argument("--model", help="model name (with --base-url) or model folder (in-process)")
    p.add_argument("--json", action="store_true", help="print the whole episode as JSON at the end")
    p.set_defaults(func=run)


def _tool_names(args: argparse.Namespace) -> list[str]:
    if args.tools is not None:
        names = [t.strip() for t in args.tools.split(",") if t.strip()]
        if not names:
            raise ValueError("--tools names no tool (comma-separated names; omit it for the default tools)")
        return names
    names = DEFAULT_TOOLS.split(",")
    if args.index:
        names.insert(0, "search_documents")
    if args.root:
        names += ["list_files", "read_file"]
    return names


@contextlib.contextmanager
def _server_errors_as_one_line(openai, where):
    """The server unreachable or refusing a request: the CLI's one-line error, not the client's traceback."""
    try:
        yield
    except openai.APIConnectionError as exc:
        raise ConnectionError(f"cannot reach the server at {where()}: {exc}") from None
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        if isinstance(body.get("error"), dict):
            body = body["error"]
        message = body.get("message")
        raise ValueError(f"the server at {where()} answered {exc.status_code}: {message or exc.message}") from None


def _check_max_tokens(client, model: str, max_tokens: int, openai) -> None:
    """--max-tokens that no prompt leaves room for, refused before the first step (each step would be a 400) when
    the server's model card says its context length (ours does; other servers may not)."""
    try:
        card = client.models.retrieve(model)
    except openai.APIStatusError:  # a server without GET /models/{id}: its first answer will say
        return
    context = (getattr(card, "model_extra", None) or {}).get("context_length")
    if isinstance(context, int) and max_tokens >= context:
        raise ValueError(f"--max-tokens must be less than the model's context length ({context} tokens, "
                         f"prompt included), got {max_tokens}")


def run(args: argparse.Namespace) -> int:
    import json

    from quicksilver.agent import build_tools, format_step, run_agent

    task = sys.stdin.read() if args.task == "-" else args.task
    if not task.strip():
        raise ValueError("the task is empty")
    if args.max_steps < 1:
        raise ValueError("--max-steps must be at least 1")
    if not 1 <= args.search_k <= 20:
        raise ValueError("--search-k must be from 1 to 20")
    if not args.python_timeout > 0:
        raise ValueError("--python-timeout must be > 0 seconds")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.temperature is not None and not 0 <= args.temperature <= 2:  # nan fails this too
        raise ValueError(f"--temperature must be from 0 to 2, got {args.temperature}")
    # the server would refuse them with a 400 at the first step: SamplingParams checks the same bounds now
    SamplingParams(presence_penalty=args.presence_penalty or 0.0, frequency_penalty=args.frequency_penalty or 0.0)
    from quicksilver.engine import model_thread

    # in-process, one thread runs all torch work: the server's forwards and the search tool's embeddings
    worker = None if args.base_url else model_thread()
    tools = build_tools(_tool_names(args), root=args.root, index_path=args.index, python_timeout=args.python_timeout,
                        search_k=args.search_k, torch_thread=worker)
    if args.first_tool and args.first_tool not in {t.name for t in tools}:
        raise ValueError(f"--first-tool {args.first_tool!r} is not among the tools")
    first_choice = {"type": "function", "function": {"name": args.first_tool}} if args.first_tool else "auto"

    import openai
    from openai import OpenAI

    base_url = args.base_url
    with contextlib.ExitStack() as stack, _server_errors_as_one_line(openai, lambda: base_url):
        if args.base_url:
            base_url, model = args.base_url, args.model
            client = OpenAI(base_url=base_url, api_key=args.api_key, max_retries=0, timeout=600)
            if model is None:
                model = client.models.list().data[0].id
        else:
            from quicksilver.agent.local_server import serve_in_thread
            from quicksilver.api.server import create_app

            # create_app loads the model on that thread, and the engine decodes there
            base_url = stack.enter_context(serve_in_thread(create_app(args.model, index_path=args.index,
                                                                      worker=worker)))
            client = OpenAI(base_url=base_url, api_key="local", max_retries=0, timeout=600)
            model = client.models.list().data[0].id
        _check_max_tokens(client, model, args.max_tokens, openai)
        print(f"agent: model {model!r} at {base_url}; tools: {', '.join(t.name for t in tools)}", file=sys.stderr)
        result = run_agent(client, model, task, tools, max_steps=args.max_steps, first_tool_choice=first_choice,
                           max_tokens=args.max_tokens, temperature=args.temperature,
                           presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                           on_step=lambda step: print(format_step(step) + "\n", flush=True),
                           final_answer=args.final_answer)
    if args.json:
        print(json.dumps(result.to_dict(), ensure_ascii=False))
    if result.answer is not None:
        forced = f" (asked for without tools: {result.forced_by.replace('_', ' ')})" if result.forced_by else ""
        print(f"final answer{forced}: {result.answer.strip()}")
    else:
        print(f"no answer after {args.max_steps} steps")
    if result.sources:
        print("sources: " + ", ".join(f"{s['path']}:{s['lines'][0]}-{s['lines'][1]}" for s in result.sources))
    fwd = f", {result.forwards} forwards" if result.forwards is not None else ""
    print(f"[{result.stopped_because}] {len(result.steps)} steps, {result.total_seconds:.2f} s total, "
          f"{result.mean_step_seconds:.2f} s/step{fwd}", file=sys.stderr)
    return 0 if result.answer is not None else 1
