"""What both training flows do around their roles once the run is claimed: start one
Prefect task per role, watch their progress until they end, and collect their results.

`train` (flows/train.py) and `train_sync` (flows/train_sync.py) share all of it: the
colocated sync loop writes the same `train` status document as the async train role.
The run's id, its claim and its resolved config are flows/run_claim.py's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from sluice.flows.cluster import RayRoles
from sluice.infra.config.run import RunConfig
from sluice.infra.outages import outage_cause, within
from sluice.tasks.process.launcher import close_launcher, warm_launcher
from sluice.tasks.process.supervisor import RunStopped, forget_stop, run_role, stop_roles
from sluice.tasks.run.control import RunControl
from sluice.tasks.run.paths import run_paths
from sluice.tasks.run.status import read_statuses

T = TypeVar("T")

ROLE_TASK_NAMES = {
    "rollout": "generate-rollouts",
    "reward": "score-rollouts",
    "train": "train-policy",
    "evaluate": "evaluate-policy",
}


@contextmanager
def role_launcher(config: RunConfig | None = None) -> Iterator[None]:
    """The role launcher of one flow run: started now, so the roles' imports overlap the
    run's set-up, and closed when the roles have ended or the flow fails before them.
    A launcher left running would start the next run's roles with its own imports and
    environment (PYTHONPATH included), and that run's clock would not carry its start-up.
    Roles placed by Ray start from launchers on their nodes: none is warmed here.
    """
    if config is None or config.cluster.engine == "local":
        warm_launcher()
    try:
        yield
    finally:
        close_launcher()


def format_duration(seconds: float) -> str:
    """12s, 8m20s, 1h05m: short enough for a progress line."""
    whole = max(0, round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def seconds_left(steps_done: int, seconds_for_steps: float, steps_left: int) -> float | None:
    """Seconds to the last step at the pace so far; None until a step has been timed.

    `steps_done` steps took `seconds_for_steps`; `steps_left` remain.
    """
    if steps_done <= 0 or seconds_for_steps <= 0:
        return None
    return max(0, steps_left) * seconds_for_steps / steps_done


class StepPace:
    """The training pace seen in the train role's status documents, for the ETA.

    The clock starts at the first step completed while watching, not at the flow's
    start: model loading and (async) the rollout pipeline filling up happen once and
    would stretch every estimate. Steps are timed by the `updated_at` the role stamps on
    its document right after a step, so the watch's 5 s polling adds no error and a role
    on another machine with a skewed clock still measures its own durations.
    """

    def __init__(self) -> None:
        self._last_step: int | None = None
        self._start_step = 0
        self._first: tuple[int, float] | None = None
        self._latest: tuple[int, float] | None = None

    def observe(self, train_status: dict[str, Any]) -> None:
        step, at = train_status.get("step"), train_status.get("updated_at")
        if step is None or at is None:
            return
        if self._last_step is None or step < self._last_step:
            # The first document seen may be stale (the run before a resume) or a
            # start-up write; a step number going down is a role re-training from its
            # last committed version. Either way, time only steps completed after it.
            self._start_step, self._first, self._latest = step, None, None
        self._last_step = step
        # Only documents written right after a step carry `wall_time_s`.
        if step <= self._start_step or "wall_time_s" not in train_status:
            return
        if self._first is None or self._latest is None:
            self._first = self._latest = (step, at)
        elif step > self._latest[0]:
            self._latest = (step, at)

    def eta_s(self, total_steps: int) -> float | None:
        if self._first is None or self._latest is None:
            return None
        (first_step, first_at), (step, at) = self._first, self._latest
        return seconds_left(step - first_step, at - first_at, total_steps - step)


def progress_line(
    statuses: dict[str, dict[str, Any]],
    total_steps: int,
    elapsed_s: float | None = None,
    eta_s: float | None = None,
) -> str:
    train = statuses.get("train", {})
    rollout = statuses.get("rollout", {})
    evaluation = statuses.get("evaluate", {})

    def fmt(value: Any, spec: str = ".3f") -> str:
        return "-" if value is None else format(value, spec)

    def duration(seconds: float | None) -> str:
        return "-" if seconds is None else format_duration(seconds)

    return (
        f"step {train.get('step', 0)}/{total_steps}"
        f" | elapsed {duration(elapsed_s)} | ETA {duration(eta_s)}"
        f" | version {rollout.get('policy_version', '-')}"
        f" | reward {fmt(train.get('reward_mean'))}"
        f" | held-out {fmt(evaluation.get('last_reward'))}"
        f" | staleness {fmt(train.get('staleness_mean'), '.2f')}"
        f" | gen {fmt(rollout.get('tokens_per_s'), '.0f')} tok/s"
        f" | train {fmt(train.get('trained_tokens_per_s'), '.0f')} tok/s"
    )


def run_roles(
    roles: list[str],
    task_names: dict[str, str],
    retries: int,
    config_path: str,
    run_id: str,
    mlflow_run_id: str,
    log_dir: str,
    runner: RayRoles | None = None,
) -> dict[str, Any]:
    """One Prefect task per role, each supervising its own OS process, restarted up to
    `retries` times (an outage the roles wait out costs none).

    With `runner` (`RayRoles`, `cluster.engine: ray`; flows/cluster.py) each task is
    placed on a Ray node by its role's `cluster.<role>` placement and starts the role's
    process there, from the config it is handed (the node may not see `config_path`)."""
    forget_stop(run_id)
    if runner is not None:
        return runner.place(roles)
    return {
        role: run_role.with_options(name=task_names[role], retries=retries).submit(
            role, config_path, run_id, mlflow_run_id, log_dir
        )
        for role in roles
    }


def watch_progress(
    config: RunConfig,
    run_id: str,
    futures: dict[str, Any],
    interval_s: float = 5.0,
    started: float | None = None,
    placed: RayRoles | None = None,
) -> None:
    """Console line and Prefect progress artifact until every role has finished.

    Serves both flows: the synchronous loop writes the same `train` status document.
    `started` (time.monotonic() at the flow's start) is when `trainer.time_budget_s`
    began to run out; when it has, the roles are told to stop. With `placed` (roles on
    Ray), a role whose node was lost is placed again (the trainer too: a failover), or
    the run stops once one was lost more than `role_retries` times.
    """
    paths = run_paths(config, run_id)
    total = config.trainer.total_steps
    budget = config.trainer.time_budget_s
    artifact_id = create_progress_artifact(0.0, key=None, description=f"Sluice run {run_id}")
    started = time.monotonic() if started is None else started
    pace = StepPace()
    last_state = ""
    control = RunControl(config, paths)
    poller = StatusPoller(config, run_id, interval_s if budget is None else 0.5)
    stopping = False
    first = best_effort(partial(read_statuses, config, paths)) or {}
    watchdog = WatchdogEvents(run_id, first.get("train", {}))

    def show(statuses: dict[str, dict[str, Any]], last_state: str) -> str:
        """Progress artifact and console line; the line only when the roles report
        something new, not on every tick of the clock. Returns the state shown."""
        train = statuses.get("train", {})
        pace.observe(train)
        step = train.get("step", 0)
        elapsed, eta = time.monotonic() - started, pace.eta_s(total)
        if config.trainer.time_budget_s is not None:  # the budget ends the run first
            left = max(0.0, config.trainer.time_budget_s - elapsed)
            eta = left if eta is None else min(eta, left)
        update_progress_artifact(
            artifact_id,
            progress=100.0 * min(step, total) / total,
            description=(
                f"Sluice run {run_id}: step {step}/{total}, elapsed {format_duration(elapsed)}"
                f", ETA {'-' if eta is None else format_duration(eta)}"
            ),
        )
        state = progress_line(statuses, total)
        if state != last_state:
            print(progress_line(statuses, total, elapsed, eta), flush=True)
        return state

    try:
        while not all(finished(f) for f in futures.values()):
            nap(futures, interval_s if budget is None else min(interval_s, 0.5))
            if budget is not None and time.monotonic() - started >= budget:
                if best_effort(control.done_marker, None) is None:
                    best_effort(partial(control.mark_done, f"time budget of {budget:g} s reached"))
                budget = None
            last_state = show(poller.latest(), last_state)
            watchdog.emit_new(poller.latest().get("train", {}))
            if placed is not None:
                replace_lost_roles(placed, futures, control, poller.latest())
                placed.observe(poller.latest())
            failed = [r for r, f in futures.items() if ended_badly(f.state)]
            if failed and not stopping:  # one role failed for good: stop the others
                stopping = True
                stop_roles(run_id)
                # For roles elsewhere; from a thread, since storage may be what failed.
                reason = f"role failed: {', '.join(failed)}"
                threading.Thread(
                    target=best_effort, args=(partial(control.mark_done, reason),), daemon=True
                ).start()
    except RunStopped:
        raise  # a role lost too often: the other roles were stopped where it was raised
    except BaseException:
        # Ctrl-C, SIGTERM, or an error in the watch: the flow is leaving, so its roles
        # flush and stop rather than run on unwatched (and keep this process alive).
        stop_and_wait(run_id, control, list(futures.values()), "the flow was interrupted")
        raise
    finally:
        poller.close()
    # Once more, for the last line and a firing that stopped the run; not waiting out a
    # hung store (its client's timeouts times its retries are minutes) before the stop
    # line: then the poller's last snapshot stands.
    final = within(partial(best_effort, partial(read_statuses, config, paths)), FINAL_READ_S)
    final = final or poller.latest()
    watchdog.emit_new(final.get("train", {}))  # a firing that stopped the run
    if placed is not None:  # a failover whose new trainer finished between two reads
        placed.observe(final)
    if not any(ended_badly(f.state) for f in futures.values()):
        # Finished (storage answers): read once more, so the last line shows the end.
        show(final, last_state)


STOP_WAIT_S = 60.0
"""How long a stopping flow waits for its roles to flush and exit."""


def stop_and_wait(run_id: str, control: RunControl, futures: list[Any], reason: str) -> None:
    """Tell the run's roles to stop (those this process supervises by SIGTERM, those on
    other nodes by the run's `done` marker, which a hung store may not take) and wait
    up to `STOP_WAIT_S` for their tasks to end."""
    stop_roles(run_id)
    within(partial(best_effort, partial(control.mark_done, reason)), FINAL_READ_S)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline and not all(finished(f) for f in futures):
        time.sleep(0.5)


def replace_lost_roles(
    placed: RayRoles,
    futures: dict[str, Any],
    control: RunControl,
    statuses: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Place again each role whose Ray node was lost; when that cannot be (too many
    losses), stop the other roles and raise the one line. `statuses`: the roles' last
    status documents (a trainer failover keeps them)."""
    for role, future in list(futures.items()):
        if role not in placed.task_names:
            continue
        future.wait(0)  # collects a crash Ray reports (see `finished`)
        state = future.state  # one read of the API per role and tick
        try:
            if not state.is_final():
                placed.check_started(role, state)
                continue
            replacement = placed.replace_lost(role, future, state, statuses)
        except RunStopped as stopped:
            others = [f for r, f in futures.items() if r != role]
            stop_and_wait(placed.run_id, control, others, str(stopped).split(":")[0])
            raise
        if replacement is not None:
            futures[role] = replacement


def ended_badly(state: Any) -> bool:
    """Failed (the role's process failed past its retries) or crashed (its task died
    with the worker or node that ran it)."""
    return bool(state.is_failed() or state.is_crashed())


def nap(futures: dict[str, Any], seconds: float, slice_s: float = 0.5) -> None:
    """Sleep up to `seconds`, waking within `slice_s` of a role's task ending: a run
    that is over, or a role that failed, does not wait for the next progress line."""
    deadline = time.monotonic() + seconds
    ended = sum(finished(f) for f in futures.values())
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(slice_s, left))
        if sum(finished(f) for f in futures.values()) != ended:
            return


def finished(future: Any) -> bool:
    """Whether a role's task has ended. A task on a Ray node that died ends without
    telling the Prefect API (its run stays Running there); waiting on the future for
    no time collects the crash Ray reports."""
    future.wait(0)
    return bool(future.state.is_final())


WATCHDOG_EVENT = "sluice.watchdog.fired"
"""The Prefect event each mismatch-watchdog firing emits (an automation can route it)."""


class WatchdogEvents:
    """Each firing the train status lists, emitted once as a Prefect event. The flow
    emits them (it holds the Prefect API); firings a resumed run's status already held
    were emitted by the flow that saw them."""

    def __init__(self, run_id: str, train_status: dict[str, Any]) -> None:
        self.run_id = run_id
        self.seen = {self._key(f) for f in train_status.get("watchdog_last", [])}

    @staticmethod
    def _key(firing: dict[str, Any]) -> tuple[str, int]:
        return str(firing.get("signal")), int(firing.get("step", -1))

    def emit_new(self, train_status: dict[str, Any]) -> int:
        from prefect.events import emit_event

        emitted = 0
        for firing in train_status.get("watchdog_last", []):
            if self._key(firing) in self.seen:
                continue
            self.seen.add(self._key(firing))
            emit_event(
                event=WATCHDOG_EVENT,
                resource={
                    "prefect.resource.id": f"sluice.run.{self.run_id}",
                    "prefect.resource.name": self.run_id,
                },
                payload=dict(firing),
            )
            emitted += 1
        return emitted


class StatusPoller:
    """The roles' status documents, read in a background thread every `interval_s`.

    The watch loop takes the newest snapshot and never waits on storage: while the
    object store hangs, a read can take minutes (the client's timeouts times its
    retries), and the loop must still see a role fail and stop the others.
    """

    def __init__(self, config: RunConfig, run_id: str, interval_s: float) -> None:
        self._config, self._paths = config, run_paths(config, run_id)
        self._interval_s = interval_s
        self._latest: dict[str, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sluice-status", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            read = best_effort(partial(read_statuses, self._config, self._paths))
            if read is not None:  # None: storage did not answer; the last read stands
                self._latest = read
            self._stop.wait(self._interval_s)

    def latest(self) -> dict[str, dict[str, Any]]:
        return self._latest

    def close(self) -> None:
        self._stop.set()


FINAL_READ_S = 10.0
"""How long the watch waits for its last read of the statuses once the roles ended."""


def best_effort(read: Callable[[], T], default: T | None = None) -> T | None:
    """`read()`, or `default` when storage does not answer (the watch outlives an outage)."""
    try:
        return read()
    except Exception as err:  # noqa: BLE001 - anything but an outage is re-raised
        if outage_cause(err) is None:
            raise
        return default


def role_results(futures: dict[str, Any]) -> None:
    """Wait for every role task; raise the reason the run stopped, if it did not finish.

    `RunStopped` (an outage that outlasted the wait, a damaged checkpoint) is raised
    before the failures it caused, which would name a symptom.
    """
    errors = []
    for future in futures.values():
        try:
            future.result()
        except Exception as err:  # noqa: BLE001 - re-raised below, the most telling first
            errors.append(err)
    for err in errors:
        if isinstance(err, RunStopped):
            raise err
    if errors:
        raise errors[0]
