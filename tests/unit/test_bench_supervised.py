"""bench_supervised's training rows: the rollout's prompt, then the answer and the end
token, with the loss on those alone."""

from itertools import islice

from sluice.infra.config import load_config
from sluice.tasks.prompts import PromptSource
from tests.benchmarks.bench_supervised import IGNORE_INDEX, supervised_examples
from tests.unit.synthetic import SHIPPED


def source(tmp_path):
    config = load_config("reasoning_gym_mix", [f"model.path={SHIPPED}", f"workdir={tmp_path}"])
    return PromptSource(config).use_policy(SHIPPED)


def test_each_row_is_the_rollouts_prompt_then_the_reference_answer_and_the_end(tmp_path):
    src = source(tmp_path)
    eos = 99
    for index, (ids, labels) in enumerate(islice(supervised_examples(src, eos), 5)):
        row = src.train_row(index)
        prompt = src.encode_prompt(row)
        answer = src.problem.reference_response(row)
        assert ids[: len(prompt)] == prompt and len(ids) == len(labels)
        assert labels[: len(prompt)] == [IGNORE_INDEX] * len(prompt)
        assert labels[len(prompt) :] == ids[len(prompt) :] and ids[-1] == eos
        assert src.tokenizer.decode(ids[len(prompt) : -1]) == answer


def test_max_terms_keeps_only_the_rows_up_to_that_many_terms(tmp_path):
    src = source(tmp_path)
    kept = [i for i in range(40) if src.train_row(i)["num_terms"] <= 2]
    assert 0 < len(kept) < 40  # the mix has 2-4 terms
    expected = [src.encode_prompt(src.train_row(i)) for i in kept[:4]]
    got = [ids for ids, _ in islice(supervised_examples(src, 99, max_terms=2), 4)]
    assert [ids[: len(prompt)] for ids, prompt in zip(got, expected, strict=True)] == expected
