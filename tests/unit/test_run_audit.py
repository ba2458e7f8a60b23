"""What the run audit calls a problem (tasks/run/audit.py): the books of a clean run pass,
and each kind of damage is named."""

from sluice.tasks.run.audit import RunAudit


def clean_books() -> RunAudit:
    return RunAudit(
        "run",
        total_steps=2,
        max_staleness_allowed=1,
        versions=[0, 1, 2],
        alias_version=2,
        groups_not_whole={"rollouts": [], "scored": []},
    )


def test_the_books_of_a_clean_run_have_no_problem() -> None:
    assert clean_books().problems() == []


def test_a_group_short_of_its_size_in_a_stream_is_a_problem() -> None:
    audit = clean_books()
    audit.groups_not_whole["scored"] = [3]
    (problem,) = audit.problems()
    assert "group size" in problem and "'scored': [3]" in problem


def test_a_trained_shard_the_trainer_never_acked_is_a_problem() -> None:
    audit = clean_books()
    audit.ledger_mismatch = ["shard-a"]
    (problem,) = audit.problems()
    assert "acks" in problem and "shard-a" in problem
