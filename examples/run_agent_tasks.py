"""Run the example agent tasks against a server and report success rate and latency per step.

    python examples/run_agent_tasks.py [--model FOLDER] [--base-url URL]

Without --base-url the Quicksilver server is started in-process. The search tasks use an index built from
tests/data/docs/corpus (created in a temporary folder). A task succeeds when the final answer contains `expect`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
from pathlib import Path

import httpx
from openai import OpenAI

from quicksilver.agent import build_tools, format_step, run_agent
from quicksilver.decoding.prefix_cache import DEFAULT_PREFIX_CACHE_MB
from quicksilver.engine import model_thread
from quicksilver.rag import Index

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parent / "tests" / "data" / "docs" / "corpus"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model folder (in-process) or model id (with --base-url)")
    ap.add_argument("--base-url")
    ap.add_argument("--max-steps", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--prefix-cache-mb", type=float, default=DEFAULT_PREFIX_CACHE_MB,
                    help="in-process server: memory for the prefix cache shared by the steps (0: off)")
    ap.add_argument("--search-k", type=int, default=1,
                    help="passages per search (the shipped models were trained on 256-token conversations)")
    ap.add_argument("--presence-penalty", type=float, help="sent with every request (OpenAI's presence_penalty)")
    ap.add_argument("--frequency-penalty", type=float, help="sent with every request (OpenAI's frequency_penalty)")
    args = ap.parse_args()
    tasks = json.loads((HERE / "agent_tasks.json").read_text())
    # one thread for all torch work in this process (an in-process server's forwards, the index's and the search
    # tool's embeddings): with libgomp a second one slows the forwards (quicksilver.engine.model_thread)
    worker = None if args.base_url else model_thread()
    index_path = Path(tempfile.mkdtemp()) / "docs.sqlite"
    worker.submit(build_index, index_path).result() if worker else build_index(index_path)
    with contextlib.ExitStack() as stack:
        if args.base_url:
            url = args.base_url
        else:
            from quicksilver.agent.local_server import serve_in_thread
            from quicksilver.api.server import create_app

            url = stack.enter_context(serve_in_thread(create_app(args.model, index_path=str(index_path),
                                                                 prefix_cache_mb=args.prefix_cache_mb, worker=worker)))
        client = OpenAI(base_url=url, api_key="local", max_retries=0, timeout=600)
        model = args.model if args.base_url and args.model else client.models.list().data[0].id
        outcomes, step_times = [], []
        for t in tasks:
            tools = build_tools(t["tools"], root=HERE / "agent_files", index_path=index_path, search_k=args.search_k,
                                torch_thread=worker)
            result = run_agent(client, model, t["task"], tools, max_steps=args.max_steps, max_tokens=args.max_tokens,
                               presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty)
            for s in result.steps:
                print(format_step(s))
                step_times.append(s.seconds)
            ok = result.answer is not None and t["expect"] in result.answer.replace(",", "")
            outcomes.append(ok)
            print(f"=> {'PASS' if ok else 'FAIL'} ({result.stopped_because}, {len(result.steps)} steps, "
                  f"{result.total_seconds:.1f} s, forwards {result.forwards}): {t['task']}\n")
        reuse = prefix_reuse(url)
    mean = statistics.mean(step_times) if step_times else 0.0
    print(f"success {sum(outcomes)}/{len(outcomes)}; mean latency per step {mean:.2f} s over {len(step_times)} steps")
    if reuse is not None:
        print(f"server totals: {reuse[1]:.0f} of {reuse[0]:.0f} prompt tokens read from the prefix cache")


def build_index(path: Path) -> None:
    with Index(path) as index:
        index.add_paths([CORPUS])


def prefix_reuse(url: str) -> tuple[float, float] | None:
    """(prompt tokens, of which read from the prefix cache) from the server's /metrics, if it exposes them."""
    try:
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return None
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    names = ("quicksilver_prompt_tokens_total", "quicksilver_cached_prompt_tokens_total")
    return tuple(float(values[n]) for n in names) if all(n in values for n in names) else None


if __name__ == "__main__":
    main()
