"""The built-in task is long-tailed, deterministic and split-disjoint; dataset readers
accept DeepScaleR/GSM8K-style rows and reject a malformed one with its file and line."""

import json

import numpy as np
import pytest

from sluice.engines.env.problems.base import REQUIRED_ROW_KEYS, Problem, split_of
from sluice.engines.env.problems.dataset import (
    DatasetFormatError,
    DatasetProblem,
    load_dataset_rows,
)
from sluice.engines.env.problems.lengths import length_report, solution_lengths
from sluice.engines.env.problems.longtail import LongTailSum
from sluice.engines.env.problems.registry import get_problem


def test_worked_solution_for_a_hand_made_prompt():
    row = LongTailSum().make_row([7, 3, 9, 2])
    # Each step copies the labelled digit, then the running total: 7, 7+3=10, 10+9=19, 19+2=21.
    assert row["prompt"] == "a7b3c9d2:"
    assert row["solution"] == "a7=7b3=10c9=19d2=21"
    assert row["answer"] == "21"
    assert row["num_terms"] == 4
    assert set(REQUIRED_ROW_KEYS) <= set(row)


def test_reference_solution_lengths_are_long_tailed():
    stats = solution_lengths(LongTailSum(), n=5000, seed=0)
    assert stats.tail_ratio >= 4
    assert min(stats.lengths) >= 5 and max(stats.lengths) <= 210


def test_warm_start_sizes_are_uniform_over_the_whole_range():
    problem = LongTailSum()
    terms = [r["num_terms"] for r in problem.sample_warmstart_prompts(3100, seed=1)]
    counts = np.bincount(terms, minlength=problem.max_terms + 1)[problem.min_terms :]
    # 31 sizes x ~100 each (sd ~10); a long-tailed draw would put >40% on sizes 2-4.
    assert counts.min() > 50 and counts.max() < 160


def test_every_sampled_row_is_self_consistent():
    problem = LongTailSum()
    for row in problem.sample_prompts(300, seed=3) + problem.sample_prompts(100, 4, "test"):
        digits = [int(ch) for ch in row["prompt"][1:-1:2]]
        assert int(row["answer"]) == sum(digits)
        assert problem.check_answer(row, problem.reference_response(row))
        assert isinstance(problem.format_prompt(row), str)


def test_sampling_is_deterministic_per_seed_and_a_generator_continues():
    problem = LongTailSum()
    assert problem.sample_prompts(20, 5) == problem.sample_prompts(20, 5)
    assert problem.sample_prompts(20, 5) != problem.sample_prompts(20, 6)
    rng = np.random.default_rng(5)
    assert problem.sample_prompts(10, rng) + problem.sample_prompts(
        10, rng
    ) == problem.sample_prompts(20, 5)


def test_held_out_split_is_disjoint_from_train():
    problem = LongTailSum()
    train = {r["prompt"] for r in problem.sample_prompts(3000, seed=0, split="train")}
    test = {r["prompt"] for r in problem.sample_prompts(600, seed=0, split="test")}
    assert train and test and not train & test
    assert all(split_of(p, problem.test_fraction) == "test" for p in test)


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="split"):
        LongTailSum().sample_prompts(1, 0, split="validation")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_terms"):
        LongTailSum(max_terms=60)
    with pytest.raises(ValueError, match="unknown built-in problem 'nope'"):
        get_problem("nope")


def test_builtin_problem_satisfies_the_protocol_and_reports_lengths():
    problem = get_problem("longtail_sum")
    assert isinstance(problem, Problem)
    report = length_report(problem, n=500)
    assert "p50" in report and "p99/p50" in report


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_rows_keep_extra_fields_and_get_ids(tmp_path):
    path = _write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            json.dumps({"prompt": "What is 2+2?", "answer": "4", "solution": "2+2=4"}),
            "",
            json.dumps({"prompt": "Half of 1?", "answer": 0.5, "prompt_id": 17, "level": 3}),
        ],
    )
    rows = load_dataset_rows(path)
    assert [r["prompt_id"] for r in rows] == ["gsm-0", "17"]
    assert rows[1]["answer"] == "0.5" and rows[1]["level"] == 3
    assert rows[0]["task"] == "gsm" and rows[0]["solution"] == "2+2=4"


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ('{"prompt": "x"', "line 2: not valid JSON"),
        ('{"answer": "4"}', "line 2: missing field 'prompt'"),
        ('{"prompt": "x"}', "line 2: missing field 'answer'"),
        ('{"prompt": 5, "answer": "4"}', "line 2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": [4]}', "line 2: field 'answer' must be a string or number"),
        ('["x", "4"]', "line 2: expected an object"),
        ('{"prompt": "  ", "answer": "4"}', "line 2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "x", "answer": true}', "line 2: field 'answer' .*got bool"),
        ('{"prompt": "x", "answer": NaN}', "line 2: field 'answer' is not a finite number"),
    ],
)
def test_malformed_jsonl_row_names_file_and_line(tmp_path, bad_line, message):
    path = _write_jsonl(
        tmp_path / "data.jsonl", [json.dumps({"prompt": "ok", "answer": "1"}), bad_line]
    )
    before = path.read_bytes()
    with pytest.raises(DatasetFormatError, match=message) as err:
        load_dataset_rows(path)
    assert "data.jsonl" in str(err.value)
    assert path.read_bytes() == before


def test_bytes_that_are_not_utf8_are_named_by_their_own_line(tmp_path):
    # Enough good lines before the bad one that a chunked text reader would have
    # decoded past several of them before failing.
    good = "\n".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(400))
    path = tmp_path / "data.jsonl"
    path.write_bytes(good.encode() + b'\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetFormatError, match=r"data.jsonl: line 401: not valid UTF-8"):
        load_dataset_rows(path)


def test_parquet_rows_and_malformed_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "math.parquet"
    pq.write_table(
        pa.table({"prompt": ["1+1?", "2*3?"], "answer": ["2", "6"], "source": ["a", "b"]}), good
    )
    rows = load_dataset_rows(good)
    assert [r["answer"] for r in rows] == ["2", "6"] and rows[1]["source"] == "b"

    no_answer = tmp_path / "noanswer.parquet"
    pq.write_table(pa.table({"problem": ["1+1?"], "solution": ["2"]}), no_answer)
    with pytest.raises(DatasetFormatError, match="noanswer.parquet: missing column 'prompt'"):
        load_dataset_rows(no_answer)

    null_answer = tmp_path / "null.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", None]}), null_answer)
    with pytest.raises(DatasetFormatError, match="null.parquet: row 1: missing field 'answer'"):
        load_dataset_rows(null_answer)

    not_parquet = tmp_path / "junk.parquet"
    not_parquet.write_bytes(b"definitely not parquet")
    with pytest.raises(DatasetFormatError, match="junk.parquet: not a readable parquet file"):
        load_dataset_rows(not_parquet)


def test_missing_unknown_or_empty_dataset_files(tmp_path):
    with pytest.raises(DatasetFormatError, match="does not exist"):
        load_dataset_rows(tmp_path / "nope.jsonl")
    (tmp_path / "data.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetFormatError, match="unsupported dataset format '.csv'"):
        load_dataset_rows(tmp_path / "data.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DatasetFormatError, match="no rows"):
        load_dataset_rows(tmp_path / "empty.jsonl")


def test_dataset_problem_splits_by_hash_and_samples_deterministically(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "answer": str(i)}) for i in range(200)]
    problem = DatasetProblem.from_files(_write_jsonl(tmp_path / "d.jsonl", lines))
    train = {r["prompt"] for r in problem.sample_prompts(500, 0, "train")}
    test = {r["prompt"] for r in problem.sample_prompts(200, 0, "test")}
    assert test and not train & test
    assert problem.sample_prompts(5, 1) == problem.sample_prompts(5, 1)
    row = problem.sample_prompts(1, 2)[0]
    assert problem.check_answer(row, f"so x = {row['answer']}")
    assert not problem.check_answer(row, "no idea")


def test_warm_start_references_mix_worked_sums_and_bare_answers():
    problem = LongTailSum()
    rows = problem.sample_warmstart_prompts(2000, seed=3)
    direct = [r for r in rows if r["solution_style"] == "direct"]
    assert 0.45 < len(direct) / len(rows) < 0.55
    for row in rows:
        reference = problem.reference_response(row)
        assert problem.check_answer(row, reference)
        if row["solution_style"] == "direct":
            assert reference == "=" + row["answer"]
        else:
            assert reference.count("=") == row["num_terms"]
    # The mix only shapes warm-start references: RL prompts keep the worked solution.
    assert all(r["solution"].count("=") == r["num_terms"] for r in problem.sample_prompts(50, 3))


def test_warm_start_references_can_be_all_worked():
    rows = LongTailSum(direct_answer_fraction=0.0).sample_warmstart_prompts(200, seed=3)
    assert {r["solution_style"] for r in rows} == {"worked"}


def test_prompts_too_long_for_the_context_are_passed_over_the_same_way_every_time(
    tmp_path, tiny_dir, local_run_config
):
    from sluice.tasks.prompts import PromptSource, load_policy_tokenizer

    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "long " * 400, "answer": "x"}]
    path = _write_jsonl(tmp_path / "mixed.jsonl", [json.dumps(r) for r in rows])
    held_out = _write_jsonl(tmp_path / "eval.jsonl", [json.dumps(rows[0])])
    config = local_run_config(tmp_path, f"problem.dataset={path}", f"evaluation.dataset={held_out}")
    source = PromptSource(config)
    source.set_tokenizer(load_policy_tokenizer(tiny_dir), max_prompt_tokens=300)
    picked = [source.train_prompt(index) for index in range(20)]
    assert all(row["prompt"] == "1+1?" and len(ids) <= 300 for row, ids in picked)
    assert source.skipped_too_long > 0  # some groups drew the long one first
    again = PromptSource(config)
    again.set_tokenizer(load_policy_tokenizer(tiny_dir), max_prompt_tokens=300)
    assert [again.train_prompt(i)[1] for i in range(20)] == [ids for _, ids in picked]

    only_long = _write_jsonl(tmp_path / "long.jsonl", [json.dumps(rows[1])])
    hopeless = PromptSource(
        local_run_config(tmp_path, f"problem.dataset={only_long}", f"evaluation.dataset={held_out}")
    )
    hopeless.set_tokenizer(load_policy_tokenizer(tiny_dir), max_prompt_tokens=300)
    with pytest.raises(ValueError, match="group 0: 64 prompts in a row are longer than 300"):
        hopeless.train_prompt(0)


def test_a_curriculum_caps_the_size_of_each_steps_prompts_and_then_opens_the_mix(
    tmp_path, tiny_dir, local_run_config
):
    from sluice.infra.config.overrides import ConfigError
    from sluice.tasks.prompts import PromptSource, load_policy_tokenizer

    # longtail_sum rows carry num_terms; B = 2 groups a step, so steps 0-2 are groups
    # 0-5 (cap 2), steps 3-4 groups 6-9 (cap 3), and from step 5 (group 10) the mix.
    stages = "[{until_step: 3, max_terms: 2}, {until_step: 5, max_terms: 3}]"
    config = local_run_config(
        tmp_path, "trainer.prompts_per_batch=2", f"problem.curriculum={stages}"
    )
    source = PromptSource(config)
    source.set_tokenizer(load_policy_tokenizer(tiny_dir))
    sizes = [source.train_prompt(index)[0]["num_terms"] for index in range(60)]
    assert max(sizes[:6]) <= 2 and max(sizes[6:10]) <= 3
    assert max(sizes[10:]) > 3  # the whole mix again
    assert source.skipped_by_curriculum > 0
    # The same groups get the same prompts again (a re-issued group asks the same).
    again = PromptSource(config)
    again.set_tokenizer(load_policy_tokenizer(tiny_dir))
    assert [again.train_prompt(i)[0]["num_terms"] for i in range(60)] == sizes
    # Held-out prompts are the whole mix from the start.
    assert max(r["num_terms"] for r in source.eval_rows()) > 3

    with pytest.raises(ConfigError, match="until_step must increase from stage to stage"):
        local_run_config(
            tmp_path,
            "problem.curriculum=[{until_step: 5, max_terms: 2}, {until_step: 5, max_terms: 3}]",
        )
    rows = [{"prompt": "1+1?", "answer": "2"}]
    path = _write_jsonl(tmp_path / "plain.jsonl", [json.dumps(r) for r in rows])
    sizeless = PromptSource(
        local_run_config(
            tmp_path,
            f"problem.dataset={path}",
            f"evaluation.dataset={path}",
            "problem.curriculum=[{until_step: 2, max_terms: 2}]",
        )
    )
    sizeless.set_tokenizer(load_policy_tokenizer(tiny_dir))
    with pytest.raises(ValueError, match="rows have none"):
        sizeless.train_prompt(0)


def test_a_trained_step_curriculum_follows_the_answering_policy_and_min_terms_bounds_below(
    tmp_path, tiny_dir, local_run_config
):
    from sluice.infra.config.overrides import ConfigError
    from sluice.tasks.prompts import PromptSource, load_policy_tokenizer

    # Stage 1 (versions 0-1): 2 terms at most; stage 2 (versions 2-3): 3 or 4 terms only.
    stages = "[{until_step: 2, max_terms: 2}, {until_step: 4, min_terms: 3, max_terms: 4}]"
    config = local_run_config(
        tmp_path,
        "trainer.prompts_per_batch=2",
        f"problem.curriculum={stages}",
        "problem.curriculum_clock=trained",
    )
    source = PromptSource(config)
    source.set_tokenizer(load_policy_tokenizer(tiny_dir))

    def sizes(version: int | None) -> list[int]:
        return [source.train_prompt(i, version)[0]["num_terms"] for i in range(100, 140)]

    # Groups 100-139 are step 50 and beyond by issue number, yet version 1 answers them:
    # the first stage holds. Version 3 draws only 3-4 terms; version 4 the whole mix.
    assert max(sizes(1)) <= 2
    assert set(sizes(3)) == {3, 4}
    whole = sizes(4)
    assert min(whole) < 3 and max(whole) > 4
    # Without a version (or with the issued clock) the issue number decides: the mix.
    assert sizes(None) == whole
    issued = PromptSource(local_run_config(tmp_path, f"problem.curriculum={stages}"))
    issued.set_tokenizer(load_policy_tokenizer(tiny_dir))
    assert [issued.train_prompt(i, 1)[0]["num_terms"] for i in range(100, 140)] == whole

    with pytest.raises(ConfigError, match=r"min_terms \(5\) is above its max_terms \(4\)"):
        local_run_config(
            tmp_path, "problem.curriculum=[{until_step: 2, min_terms: 5, max_terms: 4}]"
        )
    with pytest.raises(ConfigError, match="curriculum_clock"):
        local_run_config(tmp_path, "problem.curriculum_clock=wall")
    none_that_big = PromptSource(
        local_run_config(
            tmp_path, "problem.curriculum=[{until_step: 2, min_terms: 40, max_terms: 40}]"
        )
    )
    none_that_big.set_tokenizer(load_policy_tokenizer(tiny_dir))
    with pytest.raises(ValueError, match=r"num_terms outside \[40, 40\]"):
        none_that_big.train_prompt(0)
