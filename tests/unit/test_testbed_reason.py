"""`testbed.hosts.unavailable_reason` names the tool a test bed lacks, so that tests which
need it skip saying what to install rather than fail midway; so does the link emulator's."""

from __future__ import annotations

import os

import pytest

from testbed import hosts as testbed
from testbed import linkem


@pytest.fixture
def as_root_with(monkeypatch):
    """Pretend to be root on a host whose PATH holds only the tools given."""
    def make(*tools: str) -> None:
        monkeypatch.setattr(os, "geteuid", lambda: 0)
        monkeypatch.setattr(testbed.shutil, "which",
                            lambda name: f"/usr/sbin/{name}" if name in tools else None)
    return make


def test_a_bed_needs_only_ip_and_tc(as_root_with) -> None:
    as_root_with("ip", "tc")
    assert testbed.unavailable_reason() is None


def test_cutting_links_needs_iptables(as_root_with) -> None:
    as_root_with("ip", "tc")
    assert testbed.unavailable_reason(partitions=True) == (
        "cutting links on the test bed needs `iptables` (Debian: apt-get install iptables)")
    as_root_with("ip", "tc", "iptables")
    assert testbed.unavailable_reason(partitions=True) is None


def test_a_missing_tc_is_named(as_root_with) -> None:
    as_root_with("ip")
    assert testbed.unavailable_reason(partitions=True) == (
        "the WAN test bed needs `tc` (iproute2) on PATH")


def test_not_root_comes_first(monkeypatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in (testbed.unavailable_reason(partitions=True) or "")


def test_delay_needs_a_compiler_unless_the_emulator_is_cached(as_root_with, monkeypatch,
                                                               tmp_path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing cached there
    tun = tmp_path / "tun"
    tun.touch()
    monkeypatch.setattr(linkem, "TUN_DEVICE", str(tun))
    as_root_with("ip", "tc")
    assert testbed.unavailable_reason() is None
    assert testbed.unavailable_reason(delay=True) == (
        "the link emulator needs a C compiler (`cc`) to build linkem.c "
        "(Debian: apt-get install gcc)")
    cached = linkem.cache_dir() / linkem._cached(None).name
    cached.parent.mkdir(parents=True)
    cached.touch(mode=0o755)
    assert testbed.unavailable_reason(delay=True) is None


def test_delay_needs_the_tun_device(as_root_with, monkeypatch, tmp_path) -> None:
    as_root_with("ip", "tc", "cc")
    monkeypatch.setattr(linkem, "TUN_DEVICE", str(tmp_path / "absent"))
    assert testbed.unavailable_reason(delay=True) == (
        f"the link emulator needs {tmp_path / 'absent'} (modprobe tun)")
