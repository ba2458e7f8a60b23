"""Roles on a Ray cluster (`cluster.engine: ray`): the task runner, what the nodes need.

The flow stays where it was started; only the role tasks go to Ray. `role_runner` opens
prefect-ray's task runner for the length of the run (joining `cluster.address`, or
starting a one-node instance), and `run_roles` submits each role's Prefect task to it
under that role's placement (`remote_options`). Each task then starts its role's
process on the node Ray chose (tasks/process/supervisor.py, `run_role_on_node`).

Three things must reach every node, and are checked before any role is placed:
storage and the tracking server (config rules, infra/config/cluster.py) and the
Prefect API the task runs report to. Without `PREFECT_API_URL` Prefect runs a
temporary server inside the flow's process, on 127.0.0.1; a Ray worker that did not
know its address would start a temporary server of its own and report there, so the
flow hands the address to every worker, and refuses a cluster that spans machines
while the API listens on loopback only.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from sluice.infra.config.cluster import url_scheme
from sluice.infra.config.run import RunConfig
from sluice.tasks.process.ray_servers import server_placement
from sluice.tasks.process.supervisor import RunStopped, how_to_continue

NAMESPACE = "sluice"
"""Ray namespace of a run's tasks and actors."""
FORWARDED_ENV = (
    "DO_NOT_TRACK",
    "MLFLOW_DISABLE_TELEMETRY",
    "PREFECT_SERVER_ANALYTICS_ENABLED",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_DEFAULT_REGION",
    "MLFLOW_TRACKING_USERNAME",
    "MLFLOW_TRACKING_PASSWORD",
)
"""The flow's environment variables every role process on a node gets too, when set."""


class ClusterError(RunStopped):
    """The Ray cluster cannot run this run's roles (said in one line, before any role
    is placed)."""

    exit_code = 2


CONNECT_TIMEOUT_S = 10.0
"""How long the head's address may take to accept a connection before the run is refused
(ray.init itself waits minutes on an address that does not answer)."""


def probe_address(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse, in one line, a `HOST:PORT` or `ray://HOST:PORT` nothing listens on."""
    if address == "auto":
        return  # Ray finds the cluster this machine is a node of, or says there is none
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ClusterError(
            f"cluster.address={address!r}: expected auto, HOST:PORT (the head's GCS, "
            "6379 by default) or ray://HOST:PORT (Ray client, 10001 by default)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as err:
        raise ClusterError(
            f"cannot join the Ray cluster at {address}: nothing answered there within "
            f"{timeout_s:g} s ({err}); start it with 'ray start --head' or fix cluster.address"
        ) from None


def prefect_api_url() -> str:
    """The Prefect API this process reports to (a temporary server's, once one runs)."""
    from prefect.client.orchestration import get_client

    return str(get_client(sync_client=True).api_url).rstrip("/")


def is_loopback(url: str) -> bool:
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def local_addresses() -> set[str]:
    """The IP addresses of this machine (what `ray.nodes()` reports for a node here)."""
    found = {"127.0.0.1"}
    with suppress(OSError):
        found.update(info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None))
    # The address routed outwards, which Ray picks for a node by default.
    with suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        found.add(probe.getsockname()[0])
    return {str(address) for address in found}


def check_nodes_reach_api(api_url: str, node_addresses: list[str]) -> None:
    """Refuse, in one line, a cluster with nodes elsewhere while the API is on loopback."""
    if not is_loopback(api_url):
        return
    elsewhere = sorted(set(node_addresses) - local_addresses())
    if elsewhere:
        raise ClusterError(
            f"the Prefect API ({api_url}) listens on this machine's loopback, which the "
            f"Ray node(s) at {', '.join(elsewhere)} cannot reach: start a Prefect server "
            "they reach (prefect server start --host 0.0.0.0) and set PREFECT_API_URL="
            "http://HOST:4200/api"
        )


def node_config(config: RunConfig, cwd: Path | None = None) -> RunConfig:
    """The config the role processes on the nodes read: the workdir replaced by
    `cluster.node_workdir`, and every local path made absolute against the flow's
    working directory (a Ray worker runs elsewhere; on a one-node instance, or with a
    shared file system, the same absolute path is the same file)."""
    cwd = cwd or Path.cwd()

    def absolute(path: str) -> str:
        return str(path if Path(path).is_absolute() else (cwd / path).resolve())

    updates: dict[str, Any] = {
        "workdir": config.cluster.node_workdir or absolute(config.workdir),
    }
    storage = config.storage.url
    if url_scheme(storage) in ("file", ""):
        updates["storage"] = config.storage.model_copy(
            update={"url": "file://" + absolute(storage.removeprefix("file://"))}
        )
    tracking = config.tracking
    tracking_updates: dict[str, Any] = {}
    if tracking.uri.startswith("sqlite:///") and not tracking.uri.startswith("sqlite:////"):
        tracking_updates["uri"] = "sqlite:///" + absolute(tracking.uri.removeprefix("sqlite:///"))
    location = tracking.artifact_location
    if location and "://" not in location:
        tracking_updates["artifact_location"] = absolute(location)
    if tracking_updates:
        updates["tracking"] = tracking.model_copy(update=tracking_updates)
    return config.model_copy(update=updates)


def worker_env(config: RunConfig, api_url: str) -> dict[str, str]:
    """Environment of the Ray workers that run role tasks (and so of the role processes)."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    env.update(config.cluster.env)
    env["PREFECT_API_URL"] = api_url
    return env


@contextmanager
def role_runner(
    config: RunConfig, task_names: dict[str, str], run_id: str, mlflow_run_id: str
) -> Iterator[RayRoles | None]:
    """The run's roles on Ray (prefect-ray's task runner, started: Ray joined or
    started, and checked); None in local mode."""
    if config.cluster.engine != "ray":
        yield None
        return
    import ray
    from prefect_ray import RayTaskRunner

    api_url = prefect_api_url()
    init_kwargs: dict[str, Any] = {
        "namespace": NAMESPACE,
        "runtime_env": {"env_vars": worker_env(config, api_url)},
        # Role logs go to files on their nodes; the flow's console keeps its progress line.
        "log_to_driver": False,
    }
    if config.cluster.address is None:
        # A one-node instance: enough logical CPUs for every role's reservation (they
        # are scheduling tokens; the roles' threads are `threads_per_role`).
        wanted = sum(
            config.cluster.placement(r).num_cpus for r in ("rollout", "reward", "train", "evaluate")
        )
        if config.servers.launch == "ray":
            wanted += config.servers.count * config.cluster.servers.num_cpus
        init_kwargs.update(
            num_cpus=max(os.cpu_count() or 1, int(wanted + 0.999)), include_dashboard=False
        )
    else:
        probe_address(config.cluster.address)
    # "local" starts a new instance: ray.init() with no address would join whatever
    # cluster RAY_ADDRESS or /tmp/ray/ray_current_cluster names (a stale one included).
    runner = RayTaskRunner(address=config.cluster.address or "local", init_kwargs=init_kwargs)
    with ExitStack() as stack:
        try:
            stack.enter_context(runner)
        except ConnectionError as err:
            raise ClusterError(
                f"cannot join the Ray cluster at {config.cluster.address}: {err}"
            ) from None
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        check_nodes_reach_api(api_url, [n["NodeManagerAddress"] for n in nodes])
        roles = RayRoles(runner, config, task_names, run_id, mlflow_run_id, log=_flow_logger())
        roles.offered = [n.get("Resources", {}) for n in nodes]
        yield roles


def check_placement_fits(config: RunConfig, role: str, offered: list[dict[str, float]]) -> None:
    """Refuse, in one line, a role no node of the cluster could ever run (Ray would
    keep its task pending, and the run would wait for it forever)."""
    placement = server_placement(config) if role == "servers" else config.cluster.placement(role)
    wanted = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
    wanted = {name: amount for name, amount in wanted.items() if amount > 0}
    if any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in offered):
        return
    shown = "; ".join(
        ", ".join(
            f"{k} {v:g}"
            for k, v in sorted(node.items())
            if not k.startswith(("node:", "memory", "object_store"))
        )
        for node in offered
    )
    section = "train" if role == "sync" else role
    raise ClusterError(
        f"no node of the Ray cluster offers what cluster.{section} asks "
        f"({', '.join(f'{k} {v:g}' for k, v in wanted.items())}); its nodes offer: {shown}"
    )


class TrainerNodeLost(RunStopped):
    """The node running the train role was lost once more than `role_retries` allows:
    the run stops, to be continued with `--resume` from the newest committed version."""

    exit_code = 75


class RayRoles:
    """The run's role tasks on Ray: placed by `cluster.<role>`, and placed again when
    the node (or worker) running one is lost.

    A lost node takes its role's process and task run with it; Prefect never hears
    how that task ended. Every role resumes from durable state wherever it starts, so
    it is submitted again, at most `role_retries` times each: rollout, reward and
    evaluate from their ledgers and the registry; the trainer (a failover) from the
    newest committed version and its trainer state on storage, once the lost one's
    trainer lease has expired (infra/lease.py), and its ranks in a new placement group.
    What the trainer had trained since its last commit is trained again. Past the
    bound the run stops with one line (the trainer's: resumable, exit code 75).
    """

    TRAINERS = ("train", "sync")

    def __init__(
        self,
        runner: Any,
        config: RunConfig,
        task_names: dict[str, str],
        run_id: str,
        mlflow_run_id: str,
        log: Any = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.task_names = task_names
        self.run_id = run_id
        self.mlflow_run_id = mlflow_run_id
        self.shipped = node_config(config).model_dump(mode="json")
        self.replaced: dict[str, int] = {}
        """Per role: times it was placed again after its node was lost."""
        self.submitted_at: dict[str, float] = {}
        """Per role: when its newest task was submitted (time.monotonic())."""
        self.offered: list[dict[str, float]] = []
        """What each node of the cluster offered when the run joined it."""
        self.log = log
        self.groups: dict[str, Any] = {}
        """Per trainer role: the placement group its ranks were placed in."""
        self.pending_failover: dict[str, Any] | None = None
        """The newest trainer failover, until the new trainer has trained a step."""

    def place(self, roles: list[str]) -> dict[str, Any]:
        """Submit each of `roles`, once every one of them fits some node of the cluster."""
        for role in roles:
            check_placement_fits(self.config, role, self.offered)
        return {role: self.submit(role) for role in roles}

    def submit(self, role: str) -> Any:
        from prefect_ray.context import remote_options

        from sluice.tasks.process.supervisor import run_role_on_node
        from sluice.tasks.run.credential import run_token

        self.submitted_at[role] = time.monotonic()
        options = self.config.cluster.placement(role).ray_options()
        group = None
        if role in self.TRAINERS and self.config.trainer.world_size > 1:
            group, options["scheduling_strategy"] = self.reserve_ranks(role)
        # Ray itself never re-runs a role task: its task run would be a stale one.
        with remote_options(**options, max_retries=0):
            return self.runner.submit(
                run_role_on_node.with_options(
                    name=self.task_names[role], retries=self.config.role_retries
                ),
                {
                    "role": role,
                    "config_json": self.shipped,
                    "run_id": self.run_id,
                    "mlflow_run_id": self.mlflow_run_id,
                    "train_group": group,
                    # Ray carries it to the node (its network must be trusted); Prefect
                    # does not store task parameter values.
                    "run_token": run_token(self.config, self.run_id),
                },
            )

    def reserve_ranks(self, role: str) -> tuple[str, Any]:
        """A placement group of one `cluster.train` bundle per trainer rank, ready; its
        name and the scheduling strategy that puts the role (rank 0) in bundle 0."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        placement = self.config.cluster.placement(role)
        bundle = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
        bundle = {name: amount for name, amount in bundle.items() if amount > 0} or {"CPU": 1}
        world = self.config.trainer.world_size
        lost = self.groups.pop(role, None)
        if lost is not None:  # its bundles on live nodes go back to the pool
            with suppress(Exception):
                ray.util.remove_placement_group(lost)
        name = f"sluice-{self.run_id}-ranks-{time.time_ns()}"
        group = self.groups[role] = placement_group(
            [dict(bundle) for _ in range(world)],
            strategy=self.config.cluster.train_strategy,
            name=name,
        )
        timeout = self.config.cluster.placement_timeout_s
        ready, _ = ray.wait([group.ready()], timeout=timeout)
        if not ready:
            ray.util.remove_placement_group(group)
            raise RunStopped(
                f"run {self.run_id} stopped: the cluster did not offer {world} x {bundle} "
                f"({self.config.cluster.train_strategy}) for the trainer's ranks within "
                f"{timeout:g} s; add nodes, lower trainer parallelism or change "
                f"cluster.train_strategy, then {how_to_continue(role, self.run_id)}"
            )
        return name, PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)

    def check_started(self, role: str, state: Any) -> None:
        """Stop the run, in one line, when `role`'s task has waited longer than
        `cluster.placement_timeout_s` for a node (its task run does not exist yet)."""
        waited = time.monotonic() - self.submitted_at.get(role, time.monotonic())
        if waited <= self.config.cluster.placement_timeout_s or not state.is_pending():
            return
        wanted = self.config.cluster.placement(role).ray_options()
        raise RunStopped(
            f"run {self.run_id} stopped: no node of the Ray cluster took the {role} role "
            f"within {waited:.0f} s (it asks {wanted}; cluster.placement_timeout_s="
            f"{self.config.cluster.placement_timeout_s:g}); add a node that offers it, then "
            f"{how_to_continue(role, self.run_id)}"
        )

    def replace_lost(
        self, role: str, future: Any, state: Any, statuses: dict[str, dict[str, Any]] | None = None
    ) -> Any | None:
        """A new future for `role` when its task was lost with its worker or node
        (None: it ended on its own, for better or worse). Raises `RunStopped` once a
        role was lost too often (`TrainerNodeLost` for the trainer). `statuses`: the
        roles' last status documents, kept with a trainer failover."""
        if not state.is_crashed():
            return None
        mark_crashed(future.task_run_id, state.message or "its Ray worker or node was lost")
        done, why = self.replaced.get(role, 0), _first_line(state.message)
        times = f"{done + 1} time{'s' if done else ''}"
        if done >= self.config.role_retries:
            if role in self.TRAINERS:
                raise TrainerNodeLost(
                    f"run {self.run_id} stopped: the node running the {role} role was lost "
                    f"({why}), {times} (role_retries={self.config.role_retries}). "
                    f"Everything committed is kept; {how_to_continue(role, self.run_id)}"
                )
            raise RunStopped(
                f"run {self.run_id} stopped: the {role} role lost its node {times} "
                f"(role_retries={self.config.role_retries}); "
                f"{how_to_continue(role, self.run_id)}"
            )
        self.replaced[role] = done + 1
        if self.log is not None:
            self.log.warning("%s lost its Ray node (%s); placing it again", role, why)
        if role in self.TRAINERS:
            self.pending_failover = self._record(role, why, statuses or {})
        return self.submit(role)

    def _record(self, role: str, why: str, statuses: dict[str, dict[str, Any]]) -> dict | None:
        from sluice.tasks.run.failovers import record_loss
        from sluice.tasks.run.paths import run_paths
        from sluice.tasks.run.status import read_statuses

        try:
            # The watch's snapshot may be seconds old: the step the lost trainer reached
            # is read now (the statuses the roles wrote last).
            with suppress(Exception):
                fresh = read_statuses(self.config, run_paths(self.config, self.run_id))
                statuses = fresh if fresh.get("train") else statuses
            return record_loss(self.config, self.run_id, role, why, statuses)
        except Exception as exc:  # noqa: BLE001 - the record is bookkeeping: fail over anyway
            if self.log is not None:
                self.log.warning("trainer failover not recorded: %s", _first_line(str(exc)))
            return None

    def observe(self, statuses: dict[str, dict[str, Any]]) -> None:
        """Note the end of a pending trainer failover, once the new trainer has trained."""
        from sluice.tasks.run.failovers import note_recovery

        pending = self.pending_failover
        if pending is None:
            return
        with suppress(Exception):  # bookkeeping: the next tick tries again
            if note_recovery(self.config, self.run_id, pending, statuses):
                self.pending_failover = None
                if self.log is not None:
                    self.log.info(
                        "%s failed over: training again %.0f s after its node was lost",
                        pending["role"],
                        time.time() - pending["lost_at"],
                    )


def _flow_logger() -> Any:
    from prefect import get_run_logger

    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow run: the module's logger
        import logging

        return logging.getLogger("sluice")


def _first_line(text: str | None) -> str:
    return (text or "no message").strip().splitlines()[0][:300]


def mark_crashed(task_run_id: Any, message: str) -> None:
    """Tell the Prefect API that a task run died with its node (it still says Running)."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    with suppress(Exception):  # best effort: the UI is late, the run goes on
        get_client(sync_client=True).set_task_run_state(
            task_run_id, Crashed(message=_first_line(message)), force=True
        )
