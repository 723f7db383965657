"""Planning puzzles where diffusion models shine at small scale: Countdown and 4x4 Sudoku.

Formats follow the common research setups: Countdown answers are comma-separated equations
(``44-15=29,79-29=50``), Sudoku boards are four lines of digits with 0 for a blank. Verifiers accept
ANY valid solution, not only the reference one.
"""

from __future__ import annotations

import random
import re
from collections import Counter

from quicksilver.tasks.base import (
    Example,
    Split,
    Task,
    check_split,
    clean_output,
    history_turns,
    pick,
    system_turn,
    user_turn,
)

_EQUATION = re.compile(r"(\d+)\s*([-+*/x×÷])\s*(\d+)\s*=\s*(\d+)")
_OPS = {"+": "+", "-": "-", "*": "*", "x": "*", "×": "*", "/": "/", "÷": "/"}

_CD_ASKS = (
    "Using the numbers {nums}, make {target}. Use each number exactly once with + - * /.",
    "Countdown: numbers {nums}, target {target}.",
    "Combine {nums} with + - * / to get {target}. Every number must be used once.",
    "Reach {target} from {nums} using basic arithmetic, each number once.",
    "Make {target} out of {nums}.",
    "Numbers: {nums}. Target: {target}. Give the equations.",
    "How can I get {target} using {nums} once each with + - * and /?",
    "Find equations that turn {nums} into {target}.",
    "Target {target}. Numbers {nums}. Solve it.",
    "Get to {target} with {nums}; each number exactly once.",
    "Can you make {target} from {nums} using + - * /?",
    "Puzzle: use {nums} (once each) to reach {target}.",
)
_PLAN_SYSTEMS = (
    "You solve number and logic puzzles. Reply with the solution only.",
    "You are a puzzle solver.",
    "Solve puzzles exactly; no explanations.",
    "You are good at Countdown and Sudoku.",
)


def _combine(rng: random.Random, a: int, b: int) -> tuple[str, int, int, int] | None:
    """A random valid step on a and b: (op, left, right, result) with positive integer results."""
    options = [("+", a, b, a + b)]
    hi, lo = max(a, b), min(a, b)
    if hi != lo:
        options.append(("-", hi, lo, hi - lo))
    if a * b <= 999:
        options.append(("*", a, b, a * b))
    if lo > 1 and hi % lo == 0:
        options.append(("/", hi, lo, hi // lo))
    return rng.choice(options)


class Countdown(Task):
    name = "countdown"
    description = "reach a target from 3-4 numbers with + - * /, each used once"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        k = rng.choice((3, 3, 4))
        nums = [rng.randint(1, 99) if rng.random() < 0.6 else rng.randint(1, 12) for _ in range(k)]
        order = nums[:]
        rng.shuffle(order)
        acc, steps = order[0], []
        for b in order[1:]:
            op, left, right, result = _combine(rng, acc, b)
            steps.append(f"{left}{op}{right}={result}")
            acc = result
        nums_text = ", ".join(map(str, nums))
        ask = pick(rng, _CD_ASKS, split).format(nums=nums_text, target=acc)
        messages = system_turn(rng, split, _PLAN_SYSTEMS) + history_turns(rng, split, p=0.1)
        messages.append(user_turn(rng, split, ask))
        return Example(
            self.name, messages, {"role": "assistant", "content": ",".join(steps)}, {"numbers": nums, "target": acc}
        )

    def verify(self, example: Example, output: str) -> bool:
        return countdown_valid(example.answer["numbers"], example.answer["target"], clean_output(output))


def countdown_valid(numbers: list[int], target: int, text: str) -> bool:
    """Equations use available numbers (inputs or earlier results), are right, use every input, end at target."""
    equations = _EQUATION.findall(text)
    if len(equations) != len(numbers) - 1:
        return False
    pool = Counter(numbers)
    for left, op, right, result in equations:
        a, b, r = int(left), int(right), int(result)
        op = _OPS[op]
        value = a + b if op == "+" else a - b if op == "-" else a * b if op == "*" else None
        if op == "/":
            if b == 0 or a % b:
                return False
            value = a // b
        if value != r:
            return False
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0:
            return False
        pool[r] += 1
    return +pool == Counter([target])


# ---- 4x4 Sudoku ------------------------------------------------------------------------------------

_SUDOKU_ASKS = (
    "Solve this 4x4 Sudoku (0 = empty):\n{board}",
    "Fill in the blanks (zeros) so every row, column and 2x2 box has 1-4:\n{board}",
    "4x4 sudoku:\n{board}",
    "Complete the grid. Each row, column and box must contain 1, 2, 3 and 4.\n{board}",
    "Here is a mini Sudoku, zeros are blanks:\n{board}\nSolve it.",
    "Solve:\n{board}",
    "Can you finish this Sudoku?\n{board}",
    "Please solve the following 4x4 puzzle where 0 marks an empty cell.\n{board}",
    "Mini sudoku, 0 means empty:\n{board}",
    "Fill the zeros:\n{board}",
    "Here's a 4 by 4 sudoku, solve it please.\n{board}",
    "Sudoku (4x4, blanks are 0):\n{board}\nAnswer with the full grid.",
)

Board = list[list[int]]


def _full_board(rng: random.Random) -> Board:
    base = [[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]]
    digits = [1, 2, 3, 4]
    rng.shuffle(digits)
    board = [[digits[v - 1] for v in row] for row in base]
    bands = [[0, 1], [2, 3]]
    rng.shuffle(bands)
    rows = [r for band in bands for r in rng.sample(band, 2)]
    board = [board[r] for r in rows]
    stacks = [[0, 1], [2, 3]]
    rng.shuffle(stacks)
    cols = [c for stack in stacks for c in rng.sample(stack, 2)]
    board = [[row[c] for c in cols] for row in board]
    if rng.random() < 0.5:
        board = [list(col) for col in zip(*board, strict=True)]
    return board


def _candidates(board: Board, r: int, c: int) -> set[int]:
    used = set(board[r]) | {board[i][c] for i in range(4)}
    br, bc = r // 2 * 2, c // 2 * 2
    used |= {board[i][j] for i in range(br, br + 2) for j in range(bc, bc + 2)}
    return {1, 2, 3, 4} - used


def count_solutions(board: Board, limit: int = 2) -> int:
    for r in range(4):
        for c in range(4):
            if board[r][c] == 0:
                total = 0
                for v in _candidates(board, r, c):
                    board[r][c] = v
                    total += count_solutions(board, limit - total)
                    board[r][c] = 0
                    if total >= limit:
                        break
                return total
    return 1


def sudoku_valid(puzzle: Board, solution: Board) -> bool:
    if len(solution) != 4 or any(len(row) != 4 for row in solution):
        return False
    for r in range(4):
        for c in range(4):
            if puzzle[r][c] and puzzle[r][c] != solution[r][c]:
                return False
    groups = [solution[r] for r in range(4)] + [[solution[r][c] for r in range(4)] for c in range(4)]
    groups += [[solution[r][c] for r in range(br, br + 2) for c in range(bc, bc + 2)] for br in (0, 2) for bc in (0, 2)]
    return all(sorted(g) == [1, 2, 3, 4] for g in groups)


def format_board(board: Board) -> str:
    return "\n".join("".join(map(str, row)) for row in board)


def parse_board(text: str) -> Board | None:
    rows = re.findall(r"(?<!\d)[0-4]{4}(?!\d)", text)
    if len(rows) < 4:
        return None
    return [[int(ch) for ch in row] for row in rows[:4]]


class Sudoku(Task):
    name = "sudoku"
    description = "4x4 Sudoku with a unique solution, 4-10 blanks"

    def generate(self, rng: random.Random, split: Split) -> Example:
        check_split(split)
        solution = _full_board(rng)
        puzzle = [row[:] for row in solution]
        want = rng.randint(4, 10)
        cells = [(r, c) for r in range(4) for c in range(4)]
        rng.shuffle(cells)
        blanks = 0
        for r, c in cells:
            if blanks == want:
                break
            keep = puzzle[r][c]
            puzzle[r][c] = 0
            if count_solutions([row[:] for row in puzzle]) == 1:
                blanks += 1
            else:
                puzzle[r][c] = keep
        ask = pick(rng, _SUDOKU_ASKS, split).format(board=format_board(puzzle))
        messages = system_turn(rng, split, _PLAN_SYSTEMS) + history_turns(rng, split, p=0.1)
        messages.append(user_turn(rng, split, ask))
        return Example(
            self.name,
            messages,
            {"role": "assistant", "content": format_board(solution)},
            {"puzzle": puzzle, "solution": solution},
        )

    def verify(self, example: Example, output: str) -> bool:
        board = parse_board(clean_output(output))
        return board is not None and sudoku_valid(example.answer["puzzle"], board)
