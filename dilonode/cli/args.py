"""From parsed command-line arguments to what a command runs with: the validated run config
and the swarm secret, and `UserError` for anything the user can fix.

Standard library only at import time (the config pulls in torch and is imported when a
config is built), so `dilonode.cli` can import it before dispatching.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dilonode.config import RunConfig

__all__ = ["UserError", "run_config_from_args", "swarm_secret"]


class UserError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def run_config_from_args(args: argparse.Namespace) -> RunConfig:
    """Config file + --set overrides + the common shortcut flags, validated once."""
    from dilonode.config import ConfigError, load_config, parse_overrides

    try:
        overrides: dict[str, Any] = parse_overrides(args.overrides)
        shortcuts = {("total_steps",): getattr(args, "steps", None),
                     ("diloco", "mode"): getattr(args, "mode", None),
                     ("codec", "name"): getattr(args, "codec", None),
                     ("paths", "out_dir"): getattr(args, "out", None),
                     ("sim", "workers"): getattr(args, "workers", None),
                     ("dist", "nproc"): getattr(args, "nproc", None),
                     ("network", "initial_peers"): getattr(args, "initial_peers", None)}
        for keys, value in shortcuts.items():
            if value is not None:
                node = overrides
                for k in keys[:-1]:
                    node = node.setdefault(k, {})
                node[keys[-1]] = value
        return load_config(args.config, overrides)
    except ConfigError as exc:
        raise UserError(str(exc)) from None


def swarm_secret(cfg: RunConfig) -> bytes:
    """The run's swarm secret (auth.secret_file / auth.secret_env); b"" for none."""
    from dilonode.net.auth import load_secret

    try:
        return load_secret(cfg.auth.secret_file, cfg.auth.secret_env, os.environ)
    except ValueError as exc:
        raise UserError(str(exc)) from None
