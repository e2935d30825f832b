"""The run config tests train with: the nano model (39k parameters) on the built-in corpus,
on the CPU, short sequences, Streaming DiLoCo with H = 6 over P = 3 fragments.

`nano_config(out_dir, **over)` validates it into a `RunConfig`; `nano_overrides(**over)` is
the same as a plain override dict, for code that takes one (child processes, `run_chaos`'s
callers building several configs). Keyword overrides are merged section by section, as
`load_config` merges a TOML file's: `diloco={"pacing": "steps"}` keeps the base's other
diloco fields. `LOOPBACK_NETWORK` holds round timings that let swarms of real processes on
one shared 2-core box finish their rounds.

    cfg = nano_config(tmp_path, run_id="swarm-test", total_steps=12,
                      network=LOOPBACK_NETWORK, diloco={"pacing": "steps"})
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from dilonode.config import RunConfig, load_config

__all__ = ["LOOPBACK_NETWORK", "NANO", "merged", "nano_config", "nano_overrides"]

NANO: dict[str, Any] = {
    "device": "cpu",
    "model": {"preset": "nano"},
    "data": {"source": "builtin", "seq_len": 32, "batch_size": 4, "eval_batches": 2},
    "inner": {"lr": 3e-3, "warmup_steps": 0},
    "diloco": {"mode": "streaming", "sync_every": 6, "num_fragments": 3,
               "fragment_sync_delay": 1, "fragment_update_alpha": 0.5},
}
# A round of the nano model takes well under a second on loopback, but a box shared with
# other swarms can stall one for many; these bounds ride that out without a skipped round.
LOOPBACK_NETWORK: dict[str, Any] = {"matchmaking_window": 20.0, "matchmaking_timeout": 40.0,
                                    "allreduce_timeout": 20.0, "max_attempts": 2}


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` with `extra` merged in, section by section (nested dicts merge, the rest
    replaces); neither argument is changed."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def nano_overrides(**over: Any) -> dict[str, Any]:
    """The base override dict with `over` merged in."""
    return merged(NANO, over)


def nano_config(out_dir: str | Path | None = None, **over: Any) -> RunConfig:
    """The base config with `over` merged in, validated; `out_dir` sets `paths.out_dir`."""
    if out_dir is not None:
        over = merged(over, {"paths": {"out_dir": str(out_dir)}})
    return load_config(overrides=nano_overrides(**over))
