"""Options several swarm benchmarks take, defined once: `add_tcp_congestion(parser)` adds
`--tcp-congestion`, and `tcp_congestion(args)` is the `[network]` entries it sets."""

from __future__ import annotations

import argparse

__all__ = ["add_tcp_congestion", "tcp_congestion"]


def add_tcp_congestion(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tcp-congestion", help="network.tcp_congestion of every node "
                        "(default: the config's, auto; 'system': the kernel's default)")


def tcp_congestion(args: argparse.Namespace) -> dict[str, str]:
    """network.tcp_congestion as --tcp-congestion says, or nothing (the config's default)."""
    return {} if args.tcp_congestion is None else {"tcp_congestion": args.tcp_congestion}
