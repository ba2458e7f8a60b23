"""The storage lease that keeps one trainer per run: held, refused, expired, taken over."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from sluice.infra.lease import LeaseHeld, LeaseLost, StorageLease
from sluice.infra.storage import open_filesystem

TTL = 1.5


@pytest.fixture
def lease_path(tmp_path):
    fs, path = open_filesystem(f"file://{tmp_path}/control/trainer.lease.json", {})
    fs.makedirs(f"{tmp_path}/control", exist_ok=True)
    return fs, path


def _lease(lease_path, ttl=TTL):
    fs, path = lease_path
    return StorageLease(fs, path, what="the trainer lease of run r", ttl_s=ttl)


def _plant(lease_path, **document):
    fs, path = lease_path
    fs.pipe_file(path, json.dumps(document).encode())


def test_a_held_lease_is_renewed_and_released(lease_path) -> None:
    fs, path = lease_path
    holder = _lease(lease_path)
    holder.acquire()
    first = json.loads(fs.cat_file(path))
    assert first["owner"] == holder.owner
    time.sleep(TTL)  # past the first expiry: renewals moved it on
    renewed = json.loads(fs.cat_file(path))
    assert renewed["owner"] == holder.owner and renewed["expires_at"] > first["expires_at"]
    assert renewed["expires_at"] > time.time()
    holder.release()
    assert not fs.exists(path)


def test_a_second_claimant_is_refused_while_the_holder_lives(lease_path) -> None:
    holder = _lease(lease_path)
    holder.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match=r"held by process \d+ on .*stop that process"):
            _lease(lease_path).acquire()
        assert time.monotonic() - started < TTL + 1.5
        holder.check()  # the refused claim took nothing from the holder
    finally:
        holder.release()


@pytest.mark.parametrize("holder", ["reaped", "zombie"])
def test_a_dead_holder_on_this_host_is_taken_over_at_once(lease_path, holder) -> None:
    # A zombie was killed (or exited) but its parent has not reaped it yet.
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    if holder == "reaped":
        gone.wait()
    else:
        time.sleep(0.5)
    try:
        _plant(
            lease_path,
            owner="gone",
            host=socket.gethostname(),
            pid=gone.pid,
            expires_at=time.time() + 3600,
        )
        claimant = _lease(lease_path)
        started = time.monotonic()
        claimant.acquire()
        assert time.monotonic() - started < 2
        claimant.release()
    finally:
        gone.wait()


def test_a_silent_holder_elsewhere_is_taken_over_when_its_lease_expires(lease_path) -> None:
    _plant(lease_path, owner="far", host="elsewhere", pid=1, expires_at=time.time() + 1.0)
    claimant = _lease(lease_path, ttl=4.0)
    claimant.acquire()  # no renewal came: taken after the expiry, not refused
    fs, path = lease_path
    assert json.loads(fs.cat_file(path))["owner"] == claimant.owner
    claimant.release()


def test_a_holder_whose_lease_was_taken_stops_committing(lease_path) -> None:
    holder = _lease(lease_path)
    holder.acquire()
    _plant(lease_path, owner="usurper", host="elsewhere", pid=1, expires_at=time.time() + 60)
    time.sleep(TTL / 3 + 0.5)  # one renewal tick sees the other owner
    with pytest.raises(LeaseLost, match="taken over by usurper"):
        holder.check()
    holder.release()
    fs, path = lease_path
    assert json.loads(fs.cat_file(path))["owner"] == "usurper"  # not removed: not ours


def test_an_unreadable_lease_document_is_replaced(lease_path) -> None:
    fs, path = lease_path
    fs.pipe_file(path, b"\xff not json")
    claimant = _lease(lease_path)
    claimant.acquire()
    assert json.loads(fs.cat_file(path))["owner"] == claimant.owner
    claimant.release()
