"""The `problem` section: what the policy is asked to solve (`ProblemConfig`), with the
settings of the ``reasoning_gym`` and ``humaneval`` problem kinds
(`problem.reasoning_gym`, `problem.humaneval`) and the curriculum.

Task names and settings are checked against reasoning-gym itself when the config is
validated (imported only when tasks are named, about a second): an unknown task names
the closest registered ones, a setting the task rejects fails with the task's own
reason, each in one line. The problem (`engines/env/problems/reasoning_gym.py`) checks
them again when it is built.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any, Literal

from pydantic import Field, model_validator

from sluice.infra.config.section import Section

Extraction = Literal["answer_tags", "boxed", "last_number"]


class ReasoningGymTask(Section):
    """One reasoning-gym task of the mix."""

    weight: float = Field(1.0, gt=0)
    """Mixing weight: the task's share of prompts is weight / (sum of the weights)."""
    settings: dict[str, Any] = {}
    """The task's own settings, passed to `reasoning_gym.create_dataset` (e.g. `min_terms: 2` for `chain_sum`); unset ones keep reasoning-gym's defaults."""
    extraction: Extraction | None = None
    """How this task's answer is read from a response; None = `problem.reasoning_gym.extraction` (`countdown`'s answer is an expression: not `last_number`)."""

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = list(cls.model_fields)
            for key in data:
                if key not in fields:
                    close = difflib.get_close_matches(str(key), fields, n=1, cutoff=0.5)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    raise ValueError(
                        f"unknown key '{key}' of a task{hint}; a task takes {', '.join(fields)}"
                    )
        return data


class ReasoningGymConfig(Section):
    """Procedural reasoning tasks from reasoning-gym (used when `problem.name` is `reasoning_gym`)."""

    tasks: dict[str, ReasoningGymTask] = {}
    """reasoning-gym task name -> its weight, settings and extraction, e.g. `{chain_sum: {weight: 2}, leg_counting: {}}`."""
    instruction: str = "Give the final answer inside <answer></answer> tags."
    """Text appended (after a blank line) to every question; say the format `extraction` reads. Empty: the question alone."""
    extraction: Extraction = "answer_tags"
    """How the final answer is read from a response: `answer_tags` (the last
    `<answer>...</answer>`), `boxed` (the last `\\boxed{...}`) or `last_number`. A response without
    one scores `reward.incorrect_reward` and is counted as unparsed."""
    format_reward: float = Field(0.0, ge=0, le=1)
    """Bonus added to the reward of a response whose answer is in the expected format, right or
    wrong: a little pull toward the format early on. 0 = off; keep it small next to
    `reward.correct_reward`."""
    dataset_seed: int = Field(0, ge=0)
    """Seed of every task's dataset: entry i is a function of the task, its settings, this seed and i."""
    dataset_size: int = Field(100_000, ge=1, le=10**9)
    """Entries per task that prompts are drawn from (uniformly, by index)."""
    test_fraction: float = Field(0.1, gt=0, lt=1)
    """Share of questions (by a hash of their text) held out for evaluation; the train and held-out splits never share a question."""

    @model_validator(mode="after")
    def _tasks_exist(self) -> ReasoningGymConfig:
        if not self.tasks:
            return self
        from reasoning_gym.factory import DATASETS  # ~1 s: only when tasks are named

        for name, task in self.tasks.items():
            if name not in DATASETS:
                close = difflib.get_close_matches(name, list(DATASETS), n=3, cutoff=0.5)
                hint = f"; closest: {', '.join(close)}" if close else ""
                raise ValueError(f"unknown reasoning-gym task '{name}'{hint}")
            config_cls = DATASETS[name][1]
            known = [f.name for f in dataclasses.fields(config_cls)]
            known = [k for k in known if k not in ("seed", "size")]
            for key in task.settings:
                if key not in known:
                    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
                    hint = f" (did you mean '{close[0]}'?)" if close else ""
                    raise ValueError(
                        f"reasoning-gym task '{name}' has no setting '{key}'{hint}; "
                        f"its settings: {', '.join(known)}"
                    )
            try:
                config_cls(**task.settings).validate()
            except (AssertionError, ValueError, TypeError) as exc:
                raise ValueError(
                    f"reasoning-gym task '{name}' rejects its settings {task.settings}: {exc}"
                ) from None
        return self


class CurriculumStage(Section):
    """One stage of a curriculum over problem size (`problem.curriculum`)."""

    until_step: int = Field(ge=1)
    """The stage holds for the prompts of training steps before this one, counted as `problem.curriculum_clock` says."""
    max_terms: int = Field(ge=1)
    """Largest problem size (a row's `num_terms`: the built-in `longtail_sum`, reasoning-gym's
    `chain_sum` and `basic_arithmetic`) a training prompt of this stage may have; larger ones are
    drawn again."""
    min_terms: int = Field(1, ge=1)
    """Smallest problem size a training prompt of this stage may have; smaller ones are drawn again (e.g. a stage of only the hard prompts once the small ones are learnt)."""

    @model_validator(mode="after")
    def _sizes(self) -> CurriculumStage:
        if self.min_terms > self.max_terms:
            raise ValueError(
                f"problem.curriculum: a stage's min_terms ({self.min_terms}) is above its "
                f"max_terms ({self.max_terms})"
            )
        return self


class HumanEvalConfig(Section):
    """HumanEval's 164 problems, scored by their unit tests (used when `problem.name` is `humaneval`)."""

    extraction: Literal["raw", "fenced"] = "raw"
    """How the program is read from a response: `raw` (the response continues the function, cut at
    the first new top-level `def`/`class`/`if`/`print`/`#`, as in Chen et al. 2021: base models) or
    `fenced` (the first ```python block, a whole function or its body: chat models). A response with
    no program in that form, or one that is not Python, scores `reward.incorrect_reward` and is
    counted as unparsed."""
    instruction: str | None = None
    """Text before HumanEval's prompt (a blank line between). None = the extraction's own (`raw`:
    "Complete the following Python function."; `fenced` adds "Answer with the whole function in a
    ```python code block."); empty: HumanEval's prompt alone."""
    test_fraction: float = Field(0.2, gt=0, lt=1)
    """Share of the 164 problems held out for evaluation (round(0.2 * 164) = 33), chosen by a hash of their task_id; the splits never share a problem."""
    split_seed: int = Field(0, ge=0)
    """Seed of the held-out choice: another seed holds out other problems."""


class ProblemConfig(Section):
    """What the policy is asked to solve."""

    name: str = "longtail_sum"
    """Built-in task name, used when `dataset` is None: `longtail_sum`, `tool_arith`,
    `reasoning_gym` (the tasks of `reasoning_gym`) or `humaneval` (HumanEval's 164 problems, scored
    by `reward.verifier: code`)."""
    dataset: str | None = None
    """A .jsonl or .parquet file of rows with `prompt` and `answer` (extra columns reach the verifier)."""
    reasoning_gym: ReasoningGymConfig = ReasoningGymConfig()
    """Tasks, mix, prompt instruction and answer format of `name: reasoning_gym` (docs/configuration.md)."""
    humaneval: HumanEvalConfig = HumanEvalConfig()
    """Extraction, instruction and held-out split of `name: humaneval` (docs/configuration.md)."""
    curriculum: list[CurriculumStage] = []
    """Training prompts from small problems first: stages in order of `until_step`, each bounding
    the size of the training prompts drawn for its steps; after the last stage, the whole mix. The
    held-out prompts are always the whole mix. Empty = no curriculum. (verl and TRL leave curricula
    to the dataset; reasoning-gym ships per-task curricula of the same kind.)"""
    curriculum_clock: Literal["issued", "trained"] = "issued"
    """What a stage's `until_step` counts. `issued`: a group's issue number //
    `trainer.prompts_per_batch`, the same prompts on every run of a seed. `trained`: the policy
    version generating the group, i.e. trained steps, so a stage lasts as written even when dynamic
    sampling draws several groups per kept one. The sync flow's step is both."""

    @model_validator(mode="after")
    def _reasoning_gym_tasks(self) -> ProblemConfig:
        if self.name == "reasoning_gym" and not self.dataset and not self.reasoning_gym.tasks:
            raise ValueError("problem.name=reasoning_gym needs problem.reasoning_gym.tasks")
        steps = [stage.until_step for stage in self.curriculum]
        if steps != sorted(set(steps)):
            raise ValueError(
                f"problem.curriculum: until_step must increase from stage to stage, got {steps}"
            )
        return self


def check_verifier(problem: ProblemConfig, verifier: str) -> None:
    """Refuse, in one line, a built-in verifier that cannot score the problem
    `problem.name` names (a `ProblemConfig`): HumanEval's rows need one that runs code."""
    uses_humaneval = problem.name == "humaneval" and not problem.dataset
    if uses_humaneval and verifier in ("builtin", "math", "reasoning_gym"):
        raise ValueError(
            f"problem.name=humaneval is scored by reward.verifier=code (not {verifier})"
        )


def problem_options(problem: ProblemConfig) -> dict[str, Any]:
    """Keyword options of the problem `problem.name` names (a `ProblemConfig`), for
    `sluice.engines.env.problems.registry.get_problem`."""
    if problem.name == "reasoning_gym":
        return dict(problem.reasoning_gym.model_dump())
    if problem.name == "humaneval":
        return dict(problem.humaneval.model_dump())
    return {}
