"""Every task verifier accepts the reference answer and rejects corrupted ones; splits hold out phrasings."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from quicksilver.tasks import TASKS, Example, render
from quicksilver.tasks.base import SYSTEM_PROMPTS, split_items
from quicksilver.tasks.code_synthesis import run_tests
from quicksilver.tasks.planning import countdown_valid, sudoku_valid
from quicksilver.testing import tiny_tokenizer
from quicksilver.tokenizer import EOS, RAINBOW_PADS, TOOL_CALLS

N = 12  # examples per task and split (code tasks run a subprocess per check)


def _examples(name: str, split: str, n: int = N) -> list[Example]:
    return [TASKS[name].generate(random.Random(f"test:{name}:{split}:{i}"), split) for i in range(n)]


def _reference(ex: Example) -> str:
    """The reference answer as the model would emit it (specials kept, EOS then rainbow padding)."""
    return render(ex, tiny_tokenizer())[1] + "".join(RAINBOW_PADS[:3])


def _bump_last_int(text: str) -> str:
    nums = list(re.finditer(r"-?\d+", text))
    m = nums[-1]
    return text[: m.start()] + str(int(m.group()) + 1) + text[m.end():]


def _content(ex: Example) -> str:
    return ex.target if isinstance(ex.target, str) else ex.target["content"]


def _corruptions(ex: Example) -> list[str]:
    """Wrong answers for ``ex``: each must be rejected."""
    task, ans = ex.task, ex.answer
    if task in ("arithmetic", "word_problem", "sums"):
        return [_bump_last_int(_content(ex)), "I am not sure.", ""]
    if task == "countdown":
        eqs = _content(ex)
        return [_bump_last_int(eqs), eqs.split(",")[0], f"{ans['target']}+0={ans['target']}"]
    if task == "sudoku":
        rows = _content(ex).split("\n")
        swapped = [rows[0][1] + rows[0][0] + rows[0][2:], *rows[1:]]  # row stays a permutation, columns break
        return ["\n".join(swapped), "\n".join(rows[:3]), "1234\n1234\n1234\n1234"]
    if task in ("json", "json_varied"):
        value = dict(ans["value"])
        key = next(iter(value))
        wrong = {**value, key: value[key] + 1 if isinstance(value[key], int | float) and not isinstance(
            value[key], bool) else (not value[key] if isinstance(value[key], bool) else value[key] + "x")}
        missing = dict(list(value.items())[1:])
        extra = {**value, "note": "extra"}
        return [json.dumps(wrong), json.dumps(missing), json.dumps(extra), json.dumps(value)[:-1]]
    if task in ("tool_call", "tool_varied"):
        if isinstance(ans, dict):  # no tool fits
            n = ans["no_call"]
            return [f"{n + 1}", f'{TOOL_CALLS}[{{"name": "get_time", "arguments": {{"city": "Oslo"}}}}] {n}']
        call = ans[0]
        args = dict(call["arguments"])
        key = next(iter(args))
        args[key] = args[key] + 1 if isinstance(args[key], int | float) else args[key] + "x"
        return [
            TOOL_CALLS + json.dumps([{"name": call["name"], "arguments": args}]),
            TOOL_CALLS + json.dumps([{"name": call["name"] + "_v2", "arguments": call["arguments"]}]),
            json.dumps([call]),  # no marker
            TOOL_CALLS + json.dumps([call, call]),
            TOOL_CALLS + json.dumps([call])[:-2],
        ]
    if task == "tool_answer":
        return ["Sorry, I could not get that.", TOOL_CALLS + "[]"]
    if task in ("retrieval", "retrieval_near"):
        if ans is None:
            return ["Esk.", "1200"]
        return ["The passages do not say.", "I think it is Zzyzx."]
    if task == "code":
        name = re.search(r"def (\w+)\(([^)]*)\)", _content(ex))
        return [f"def {name.group(1)}({name.group(2)}):\n    return None", "print('hi')", "def f(:"]
    if task == "infill":
        return ["    pass", "    return 12345"]
    if task in ("agent_step", "agent_open"):
        if "final" in ans:
            key = ans["final"]
            if key is None:
                return ["Esk.", TOOL_CALLS + "[]"]
            wrong = [f"{TOOL_CALLS}[]", "I could not find it."]
            return wrong + ([_bump_last_int(_content(ex))] if re.fullmatch(r"\d+", key) else [])
        call = ans["call"]
        name, args = call["name"], dict(call["arguments"])
        value = next(iter(args.values()))
        changed = {"calculator": _bump_last_int(value) if name == "calculator" else "",
                   "read_file": "notes.txt", "search_documents": "weather today",
                   "run_python": "print(-1)"}[name]
        wrong_args = {next(iter(args)): changed}
        partial = []  # a search that names only part of the entity ("Lighthouse" for "Kesbel Point Lighthouse")
        if name == "calculator":  # the right value written out, not computed from the task's operands
            partial = [TOOL_CALLS + json.dumps([{"name": name, "arguments": {"expression": ans["value"]}}])]
        if name == "search_documents" and len(value.split()) > 2:
            partial = [TOOL_CALLS + json.dumps([{"name": name, "arguments": {"query": " ".join(value.split()[1:])}}])]
        return partial + [
            TOOL_CALLS + json.dumps([{"name": name, "arguments": wrong_args}]),
            TOOL_CALLS + json.dumps([{"name": "list_files", "arguments": {"path": "."}}]),
            json.dumps([call]),  # no marker
            "I do not know.",
        ]
    if task == "recall":
        if ex.meta["kind"] == "json":
            value = json.loads(ans)
            key = next(iter(value))
            return [json.dumps({**value, key: value[key] + "x"}), json.dumps(dict(list(value.items())[1:])), ans[:-1]]
        return [ans + "x", ans[:-1], ans[1:], ans.swapcase() if ans.swapcase() != ans else ans + " 1"]
    raise AssertionError(f"no corruptions for {task}")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_verifier_accepts_reference_and_rejects_corruptions(name):
    task = TASKS[name]
    n = 6 if name in ("code", "infill") else N  # these start an interpreter per check
    for split in ("train", "eval"):
        for ex in _examples(name, split, n):
            assert ex.task == name
            assert task.verify(ex, _reference(ex)), f"{name}: reference rejected: {_reference(ex)!r}"
            for bad in _corruptions(ex):
                assert not task.verify(ex, bad + EOS), f"{name}: wrong answer accepted: {bad!r}"


@pytest.mark.parametrize("name", sorted(TASKS))
def test_generation_is_deterministic(name):
    a = TASKS[name].generate(random.Random("same"), "eval")
    b = TASKS[name].generate(random.Random("same"), "eval")
    tok = tiny_tokenizer()
    assert render(a, tok) == render(b, tok)


def test_eval_split_uses_held_out_phrasings():
    train, held = split_items(SYSTEM_PROMPTS, "train"), split_items(SYSTEM_PROMPTS, "eval")
    assert held and train and not set(train) & set(held)
    assert set(train) | set(held) == set(SYSTEM_PROMPTS)
    # the user turns of eval examples never equal those of train examples with the same values
    for name in ("tool_call", "json", "arithmetic", "sudoku", "retrieval"):
        train_sys = {m["content"] for ex in _examples(name, "train", 60) for m in ex.messages if m["role"] == "system"}
        eval_sys = {m["content"] for ex in _examples(name, "eval", 60) for m in ex.messages if m["role"] == "system"}
        assert not (train_sys & eval_sys) - {None}, f"{name}: system prompts leak between splits"
    with pytest.raises(ValueError):
        TASKS["json"].generate(random.Random(0), "test")


def test_countdown_checker_rules():
    assert countdown_valid([15, 44, 79], 50, "44-15=29,79-29=50")
    assert countdown_valid([15, 44, 79], 50, "79-29=50, 44-15=29".replace("79-29=50, ", "") + ",79-29=50")
    assert not countdown_valid([15, 44, 79], 50, "44-15=29,79-29=50,50*1=50")  # extra number
    assert not countdown_valid([15, 44, 79], 50, "79-29=50,44-15=29")  # 29 used before it exists
    assert not countdown_valid([4, 3, 2], 6, "4/3=1,1*6=6")  # inexact division
    assert not countdown_valid([6, 6, 2], 6, "6/6=1,1*6=6")  # third 6 does not exist


def test_sudoku_checker_accepts_any_valid_solution():
    solution = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    assert sudoku_valid([[0] * 4 for _ in range(4)], solution)
    assert not sudoku_valid([[2, 0, 0, 0]] + [[0] * 4 for _ in range(3)], solution)  # contradicts a given


def test_code_runner_times_out_and_isolates():
    assert run_tests("def f():\n    return 1", ["assert f() == 1"])
    assert not run_tests("def f():\n    while True: pass", ["f()"], timeout=0.5)
    assert not run_tests("import sys; sys.exit(3)", [])


def test_tool_answer_values_must_appear_whole():
    from quicksilver.tasks.tool_use import mentions

    assert mentions("It is 20 degrees.", "20") and mentions("That is 1086.13.", "1086.13")
    assert not mentions("It is 120 degrees", "20") and not mentions("It is 20.5", "20")
    assert not mentions("unsent", "sent")
    assert not mentions("It is -20 degrees.", "20") and mentions("It is -20 degrees.", "-20")


def test_agent_steps_offer_the_agents_own_tools_and_fit_the_training_length():
    """The training conversations must show the schemas the agent sends, and mostly fit a 256-token row."""
    from quicksilver.agent import build_tools
    from quicksilver.data.mixture import MAX_LEN
    from quicksilver.rag.chat import SEARCH_TOOL
    from quicksilver.tasks.agent_steps import tool_schema

    offered = {t.name: t.spec() for t in build_tools(["calculator", "run_python", "read_file", "list_files"], root=".")}
    offered["search_documents"] = SEARCH_TOOL
    for name, spec in offered.items():
        assert tool_schema(name) == spec
    from quicksilver.loading import resolve_model_path
    from quicksilver.tokenizer import Tokenizer

    tok = Tokenizer.load(resolve_model_path("default"))  # the shipped models' tokenizer
    examples = _examples("agent_step", "train", 80)
    lengths = [sum(len(tok.encode(part)) for part in render(ex, tok)) for ex in examples]
    assert {ex.tools[0]["function"]["name"] for ex in examples} == {"calculator", "read_file", "search_documents",
                                                                     "run_python"}
    assert {"final" in ex.answer for ex in examples} == {True, False}  # both calls and final answers are targets
    assert sum(n <= MAX_LEN for n in lengths) >= 0.5 * len(lengths), lengths


def test_agent_step_python_observation_is_what_the_sandbox_prints():
    from quicksilver.agent.tools import run_python

    seen = 0
    for i in range(200):
        ex = TASKS["agent_step"].generate(random.Random(f"py:{i}"), "train")
        calls = [m for m in ex.messages if m.get("tool_calls")]
        if calls and calls[0]["tool_calls"][0]["name"] == "run_python":
            code = calls[0]["tool_calls"][0]["arguments"]["code"]
            assert run_python(code).strip() == ex.messages[-1]["content"].strip()
            seen += 1
            if seen == 3:
                break
    assert seen == 3


def test_drills_are_trainable_but_not_in_the_default_suite():
    from quicksilver.data.mixture import resolve_mix
    from quicksilver.evaluate import eval_examples
    from quicksilver.tasks import SUITE

    assert "recall" in TASKS and "recall" not in SUITE
    assert set(SUITE) == {name for name, task in TASKS.items() if task.in_suite}
    assert resolve_mix({"recall": 1.0}) == {"recall": 1.0}  # usable in a training mixture
    held = eval_examples("recall", n=40)  # and evaluable by name on held-out seeds and phrasings
    kinds = {ex.meta["kind"] for ex in held}
    assert kinds == {"repeat", "lookup", "json"}
    train_users = {ex.messages[-1]["content"] for ex in _examples("recall", "train", 40)}
    assert not train_users & {ex.messages[-1]["content"] for ex in held}


def test_agent_open_arguments_come_from_open_sets_and_chains_take_two_tools():
    """agent_open must not be solvable by recalling a set member: file names, entities and operands vary
    widely, and chained episodes carry the looked-up number into the calculator call."""
    examples = _examples("agent_open", "train", 300)
    calls = [ex.answer["call"] for ex in examples if "call" in ex.answer]
    files = {c["arguments"]["path"] for c in calls if c["name"] == "read_file"}
    queries = {c["arguments"]["query"] for c in calls if c["name"] == "search_documents"}
    operands = {n for c in calls if c["name"] == "calculator" for n in re.findall(r"\d+", c["arguments"]["expression"])}
    assert len(files) > 0.9 * sum(c["name"] == "read_file" for c in calls) > 20
    assert len(queries) > 0.9 * sum(c["name"] == "search_documents" for c in calls) > 20
    assert any(len(n) >= 5 for n in operands) and any(len(n) == 1 for n in operands)
    chained = [ex for ex in examples if {t["function"]["name"] for t in ex.tools} > {"calculator"}]
    assert chained
    for ex in chained:  # the calculator step of a chain uses a number the earlier observation showed
        if "call" in ex.answer and ex.answer["call"]["name"] == "calculator":
            looked_up = re.findall(r"\d+", ex.answer["call"]["arguments"]["expression"])
            observed = next(m["content"] for m in ex.messages if m["role"] == "tool")
            assert any(re.search(rf"\b{n}\b", observed) for n in looked_up)
            break
    else:
        raise AssertionError("no chained calculator step among the examples")


def test_agent_open_train_documents_also_look_like_indexed_pages():
    """Half the train split's search results are laid out as an index holds a page (bare title, wrapped lines,
    several paragraphs), as the agent's real search tool returns them; the eval split keeps one format."""

    def observations(split):
        return [m["content"] for ex in _examples("agent_open", split, 300) for m in ex.messages if m["role"] == "tool"
                and m["content"].startswith("[1] (source:")]

    train = observations("train")
    pages = [o for o in train if "\n# " not in o]
    assert 0.25 * len(train) < len(pages) < 0.9 * len(train)
    assert all(o.count("\n") >= 4 for o in pages)  # title, blank line, wrapped paragraphs
    assert all("\n# " in o for o in observations("eval"))


def test_json_varied_states_every_value_and_never_a_held_out_json_wording():
    """The drill composes new wordings; none may reproduce a ``json`` task sentence or request held out for eval."""
    from quicksilver.tasks.base import split_items
    from quicksilver.tasks.json_extraction import _ASKS, RECORDS, _text_slots

    held_texts = {rec.kind: split_items(rec.texts, "eval") for rec in RECORDS}
    held_asks = [a.split("{")[0].strip() for a in split_items(_ASKS, "eval")]
    texts = set()
    for ex in _examples("json_varied", "train", 400):
        request = ex.messages[-1]["content"]
        value = ex.answer["value"]
        rec = next(r for r in RECORDS if r.schema == ex.answer["schema"])
        for v in value.values():  # every value is in the request verbatim (booleans as words)
            assert isinstance(v, bool) or str(v) in request
        for template in held_texts[rec.kind]:
            assert template.format(**_text_slots(value)) not in request
        assert not any(ask and ask in request for ask in held_asks)
        if rec.kind == "order":  # the shorthand notes never mark a value the held-out note's way
            assert f"({value['color']})" not in request and f"x{value['quantity']}" not in request
        texts.add(request)
    assert len(texts) == 400  # composed anew: no two alike
    held_users = {ex.messages[-1]["content"] for ex in _examples("json_varied", "eval", 40)}
    assert not held_users & texts


def test_worked_sum_steps_are_right_and_end_on_the_sum():
    from quicksilver.tasks.arithmetic import final_integer, worked_sum

    for a in range(0, 100, 7):
        for b in range(0, 100, 3):
            text = worked_sum(a, b)
            assert final_integer(text) == a + b
            ones, tens = re.search(r"ones (.*?);", text).group(1), re.search(r"tens (.*?);", text).group(1)
            for step in (ones.split(",")[0], tens):  # each step is a true one-digit equation
                left, right = step.split(" = ")
                assert sum(int(x) for x in left.split(" + ")) == int(right)
            assert ("carry 1" in text) == (a % 10 + b % 10 >= 10)
    with pytest.raises(ValueError):
        worked_sum(100, 1)


def test_tool_varied_states_every_argument_and_never_a_held_out_tool_request():
    """The drill composes new requests; none may contain a ``tool_call`` request or no-tool question held out
    for eval, and its held-out pieces never appear in training requests."""
    from quicksilver.tasks.base import split_items
    from quicksilver.tasks.tool_use import _NO_TOOL_ASKS, TOOLS_BY_NAME

    def fixed_parts(templates):  # the literal text between slots, long enough to be a wording
        return {p.strip(" .?!,").lower() for t in templates for p in re.split(r"\{\w+\}", t) if len(p.strip()) >= 8}

    def templates(split):
        return [*(a for spec in TOOLS_BY_NAME.values() for a in split_items(spec.asks, split)),
                *split_items(_NO_TOOL_ASKS, split)]

    trained = " | ".join(templates("train")).lower()
    held = {part for part in fixed_parts(templates("eval")) if part not in trained}  # wordings only eval has
    requests, kinds = set(), set()
    for ex in _examples("tool_varied", "train", 600):
        request = ex.messages[-1]["content"]
        if isinstance(ex.answer, dict):
            kinds.add("no_call")
        else:
            call = ex.answer[0]
            kinds.add(call["name"])
            assert call["name"] in {t["function"]["name"] for t in ex.tools}
            schema_order = [k for k in TOOLS_BY_NAME[call["name"]].properties if k in call["arguments"]]
            assert list(call["arguments"]) == schema_order
            for value in call["arguments"].values():
                assert str(value) in request
        assert not [part for part in held if part in request.lower()], request
        requests.add(request)
    assert kinds == {*TOOLS_BY_NAME, "no_call"}
    assert len(requests) > 580  # composed anew: nearly all distinct
    held_requests = {ex.messages[-1]["content"] for ex in _examples("tool_varied", "eval", 60)}
    assert not held_requests & requests


def test_retrieval_near_answers_from_the_asked_names_passage_among_look_alikes():
    from quicksilver.rag.chat import PASSAGES_HEADER

    layouts, absent = Counter(), 0
    for ex in _examples("retrieval_near", "train", 300):
        asked, names, prompt = ex.meta["asked"], ex.meta["names"], ex.messages[-1]["content"]
        passages = re.findall(r"\[\d+\] ([^\n]+)", prompt)  # the first may follow an opener on its line
        assert len(passages) == len(names) and 1 <= len(names) <= 5
        for name, passage in zip(names, passages, strict=True):  # passage i is about names[i]
            assert passage.count(name) == 3 and (name == asked or asked not in passage)
            if name != asked:  # a look-alike: it shares the asked name's first or last syllable
                assert name[:2].lower() == asked[:2].lower() or name[-2:] == asked[-2:]
        if ex.answer is not None:  # the answer is in the asked name's own passage
            assert ex.answer in passages[names.index(asked)]
        absent += asked not in names
        layouts[prompt.lstrip().startswith(PASSAGES_HEADER)] += 1
    assert 30 <= absent <= 100  # a fifth have no passage about the asked name: their answer is "not found"
    assert layouts[True] >= 100 and layouts[False] >= 100  # augment_messages' layout and the suite's wordings
