"""A test bed's per-host link settings: validated when the bed is described (no I/O), and
they decide whether the link emulator runs."""

from __future__ import annotations

import pytest

from testbed.hosts import LinkSpec, Testbed


def test_each_host_gets_its_own_link_and_the_rest_none() -> None:
    bed = Testbed(["a", "b", "c"], delays={"a": 40.0, "b": 5.0}, jitter={"a": 2.0},
                  loss={"c": 0.01})
    assert bed.emulate
    assert bed.hosts["a"].link == LinkSpec(delay_ms=40.0, jitter_ms=2.0)
    assert bed.hosts["b"].link == LinkSpec(delay_ms=5.0)
    assert bed.hosts["c"].link == LinkSpec(loss=0.01)


def test_the_emulator_runs_only_when_asked() -> None:
    assert not Testbed(["a", "b"], rate_mbit=20).emulate
    plain = Testbed(["a", "b"], emulate=True)
    assert plain.emulate and plain.hosts["a"].link == LinkSpec()
    # its router takes an address of the subnet, after the hosts and the NAT sink
    assert plain.gateway == "10.77.0.254"
    natted = Testbed(["a", "b"], nat=["b"], emulate=True)
    assert (natted.sink, natted.gateway) == ("11.77.0.254", "11.77.0.253")


@pytest.mark.parametrize("kwargs, match", [
    ({"delays": {"x": 10.0}}, r"delays = \['x'\]: not among the hosts"),
    ({"loss": {"a": 1.0}}, "loss must be in"),
    ({"jitter": {"a": -1.0}}, "must be >= 0"),
    ({"delays": {"a": float("nan")}}, "must be >= 0"),
])
def test_bad_link_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Testbed(["a", "b"], **kwargs)


def test_the_emulator_keeps_its_name_and_its_address() -> None:
    with pytest.raises(ValueError, match="the link emulator's"):
        Testbed(["linkem", "b"], emulate=True)
    assert Testbed(["linkem", "b"]).hosts["linkem"]  # no emulator, no clash
    with pytest.raises(ValueError, match="too small"):
        Testbed(["a", "b"], subnet="10.1.0.0/30", emulate=True)
    assert Testbed(["a", "b"], subnet="10.1.0.0/30")
