"""`sluice serve`: serve the flows as Prefect deployments (flows/deployments.py) from this
process until it is stopped."""

from __future__ import annotations

from sluice.infra.config.run import RunConfig


def run_serve(config: RunConfig) -> int:
    """Serve the deployments from this process until interrupted."""
    from prefect import serve
    from prefect.settings import get_current_settings

    from sluice.flows.deployments import build_deployments, next_steps
    from sluice.flows.run_secrets import hand_over

    # Credentials stay out of the deployments' parameters: the served runs read this
    # process's 0600 file (flows/run_secrets.py).
    deployments = build_deployments(hand_over(config, None))
    settings = get_current_settings()
    print(next_steps(deployments, settings.api.url, settings.ui_url), flush=True)
    serve(*deployments, print_starting_message=False)
    return 0
