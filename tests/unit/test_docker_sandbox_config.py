"""``reward.sandbox: docker`` refuses to start without an engine, in one line that says
how to get one (no engine is needed to check this)."""

import pytest


def test_a_docker_sandbox_without_an_engine_says_how_to_start_one(tmp_path):
    import docker

    from sluice.infra.docker_sandbox import DockerSandbox, SandboxUnavailable

    sock = f"unix://{tmp_path / 'no-engine.sock'}"
    nowhere = docker.DockerClient(base_url=sock, version="1.41", timeout=2)
    with pytest.raises(SandboxUnavailable, match=r"start one with `bash infra/docker/engine.sh`"):
        DockerSandbox(client=nowhere)


def test_the_reward_sandbox_key_takes_auto_process_or_docker():
    from sluice.infra.config.overrides import ConfigError
    from sluice.infra.config.run import load_config

    assert load_config("default").reward.sandbox == "auto"
    assert load_config("default", ["reward.sandbox=docker"]).reward.sandbox == "docker"
    with pytest.raises(ConfigError, match="invalid value for 'reward.sandbox'"):
        load_config("default", ["reward.sandbox=vm"])


def test_auto_falls_back_to_the_process_sandbox_and_docker_refuses_without_an_engine(
    tmp_path, monkeypatch, caplog
):
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_sandbox import SandboxUnavailable
    from sluice.tasks.sandbox import code_sandbox

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-engine.sock'}")
    code = ["reward.verifier=code"]
    with caplog.at_level("WARNING", logger="sluice.reward"):
        assert code_sandbox(load_config("default", code)) is None
    assert "reward.sandbox=auto" in caplog.text and "process sandbox" in caplog.text
    with pytest.raises(SandboxUnavailable, match="needs a Docker engine"):
        code_sandbox(load_config("default", [*code, "reward.sandbox=docker"]))
    # Verifiers that run no code start no sandbox, whatever the key says.
    assert code_sandbox(load_config("default", ["reward.sandbox=docker"])) is None


def test_the_python_tool_takes_the_code_verifiers_sandbox_choice(tmp_path, monkeypatch):
    """`episode.tools: [python]` runs where `reward.sandbox` says, whatever the verifier:
    `docker` insists on an engine for the tool too; `process` keeps it in the process
    sandbox; a run without the python tool starts no sandbox for tools."""
    from sluice.infra.config.run import load_config
    from sluice.infra.docker_sandbox import SandboxUnavailable
    from sluice.tasks.sandbox import code_sandbox
    from sluice.tasks.tool_runner import ToolBox

    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path / 'no-engine.sock'}")
    python = ["episode.tools=[python]"]
    with pytest.raises(SandboxUnavailable, match="needs a Docker engine"):
        ToolBox.for_run(load_config("default", [*python, "reward.sandbox=docker"]))
    box = ToolBox.for_run(load_config("default", [*python, "reward.sandbox=process"]))
    try:
        assert box._sandbox is None
    finally:
        box.close()
    assert code_sandbox(load_config("default", ["reward.sandbox=docker"]), for_tools=True) is None
