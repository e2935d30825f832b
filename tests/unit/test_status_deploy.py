"""deploy/ cannot be run here (no docker, no systemd as init), so lint it: every command line
in the unit files and the compose file must parse with dilonode's own CLI into a valid
config, every file they name must exist, and systemd-analyze must accept the units when it
is installed."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from dilonode.cli.args import run_config_from_args
from dilonode.cli.main import build_parser
from dilonode.config import load_config

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
MADDR = "/ip4/10.0.0.1/tcp/31337/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def parse_unit(path: Path) -> dict[str, dict[str, str]]:
    """systemd unit syntax: [Section], Key=Value, '\\' continues a line, '#'/';' comments."""
    sections: dict[str, dict[str, str]] = {}
    current, pending = None, ""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = pending + raw.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if not line or line[0] in "#;":
            continue
        if m := re.fullmatch(r"\[(\w+)\]", line):
            current = sections.setdefault(m.group(1), {})
            continue
        assert current is not None and "=" in line, f"{path.name}:{n}: not Key=Value: {line!r}"
        key, value = line.split("=", 1)
        current[key.strip()] = value.strip()
    return sections


def env_file(name: str) -> dict[str, str]:
    env = {}
    for line in (DEPLOY / "configs" / name).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            env[key] = value
    return env


def expand(cmd: str, env: dict[str, str]) -> list[str]:
    """systemd's expansion: ${VAR} is one word, $VAR is split on whitespace."""
    words = []
    for word in shlex.split(cmd):
        if m := re.fullmatch(r"\$(\w+)", word):
            words += env[m.group(1)].split()
        else:
            words.append(re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], word))
    return words


def local_paths(argv: list[str]) -> list[str]:
    """Deployed paths -> this checkout, so the configs they name can be loaded here."""
    return [a.replace("/etc/dilonode/node.toml", str(DEPLOY / "configs" / "gpu-node.toml"))
             .replace("/opt/dilonode/configs/", str(ROOT / "configs") + "/") for a in argv]


def test_units_parse_and_their_commands_are_valid_dilonode_invocations():
    assert {u.name for u in UNITS} == {"dilonode-bootstrap.service", "dilonode-node.service"}
    for unit in UNITS:
        s = parse_unit(unit)
        assert {"Unit", "Service", "Install"} <= set(s), unit.name
        svc = s["Service"]
        assert svc["KillSignal"] == "SIGTERM"  # the signal that stops a node cleanly
        assert svc["User"] != "root"
        env = env_file(Path(svc["EnvironmentFile"]).name)
        argv = expand(svc["ExecStart"], env)
        assert argv[0] == "/opt/dilonode/.venv/bin/dilonode"
        args = build_parser().parse_args(local_paths(argv[1:]))
        if args.command == "run":
            cfg = run_config_from_args(args)
            assert cfg.network.initial_peers, "node.env gives no initial peers"
            assert args.forever
        else:
            assert args.command == "bootstrap" and args.port == 31337
            assert args.status_host == "127.0.0.1"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze absent")
def test_systemd_analyze_verify_accepts_the_units(tmp_path):
    dilonode = ROOT / ".venv" / "bin" / "dilonode"
    if not dilonode.exists():
        pytest.skip("no .venv/bin/dilonode to stand in for the installed one")
    for unit in UNITS:
        # verify checks that ExecStart's program exists: point it at this checkout's.
        text = unit.read_text().replace("/opt/dilonode/.venv", str(ROOT / ".venv"))
        (tmp_path / unit.name).write_text(text)
        proc = subprocess.run(["systemd-analyze", "verify", str(tmp_path / unit.name)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert not re.search(r"Unknown (key|section)|ignoring", proc.stderr), proc.stderr


def test_unit_parser_sees_mistakes(tmp_path):
    bad = tmp_path / "bad.service"
    bad.write_text("[Service]\nExecStart=/bin/true \\\n  --flag\nno equals sign\n")
    with pytest.raises(AssertionError, match="bad.service:4: not Key=Value"):
        parse_unit(bad)


def test_example_gpu_node_config_is_valid():
    cfg = load_config(DEPLOY / "configs" / "gpu-node.toml")
    assert cfg.device == "cuda"
    assert cfg.network.host == "0.0.0.0" and cfg.network.announce_host
    # fixed, so a firewall can open exactly these
    assert cfg.network.port and cfg.network.dht_port and cfg.statesync.port
    assert cfg.status.host == "127.0.0.1"


def test_compose_services_are_valid_dilonode_invocations():
    spec = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = spec["services"]
    boot = build_parser().parse_args(services["bootstrap"]["command"])
    assert boot.command == "bootstrap" and boot.maddrs_file.startswith("/shared/")
    nodes = {k: v for k, v in services.items() if k != "bootstrap"}
    assert len(nodes) >= 2
    published = set()
    for name, svc in nodes.items():
        assert svc["depends_on"]["bootstrap"]["condition"] == "service_healthy"
        assert (ROOT / svc["build"]["context"].replace("..", ".") /
                svc["build"]["dockerfile"]).is_file()
        script = svc["command"][0]
        assert script.startswith("exec dilonode ")
        script = script.replace(f"$(cat {boot.maddrs_file})", MADDR)
        args = build_parser().parse_args(local_paths(shlex.split(script)[2:]))
        cfg = run_config_from_args(args)
        assert cfg.network.announce_host == svc["hostname"] == name
        assert cfg.network.initial_peers == (MADDR,)
        for port in svc["ports"]:
            host, outer, inner = port.split(":")
            assert host == "127.0.0.1", f"{name} publishes {port} beyond loopback"
            assert int(inner) == cfg.status.port
            published.add(outer)
    assert len(published) == len(nodes), "two nodes publish the same port"


def test_dockerfile_copies_what_exists_and_drops_root():
    lines = [ln.strip() for ln in (DEPLOY / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    assert lines[0].startswith("FROM ")
    instructions = [ln.split()[0] for ln in lines if ln.split()[0].isupper()]
    assert instructions.index("USER") < instructions.index("ENTRYPOINT")
    for ln in lines:
        if ln.startswith("COPY "):
            for src in ln.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    assert 'ENTRYPOINT ["dilonode"]' in lines
