"""gloo and NCCL pick a network interface by guessing, another one than the node's
registered address on a machine with several; a split trainer's ranks name the
interface that holds their node's address instead, unless the user named one."""

import os

import pytest

from sluice.tasks.process.ray_ranks import interface_of, name_interface


def test_the_interface_of_an_address_is_the_one_that_holds_it():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.123") is None  # TEST-NET-1: held by no interface here


@pytest.fixture
def clean_env(monkeypatch):
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.usefixtures("clean_env")
def test_both_collective_libraries_are_pointed_at_the_node_address_interface():
    name_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"


@pytest.mark.usefixtures("clean_env")
def test_an_interface_the_user_named_is_kept_and_an_unknown_address_names_none(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    name_interface("127.0.0.1")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    name_interface("192.0.2.123")
    assert "NCCL_SOCKET_IFNAME" not in os.environ
