"""The part of a worker that outlives it: outer weights and outer momentum per fragment, the
per-fragment round counters and the step, as plain CPU tensors plus a little metadata.

`WorkerState` is what checkpoints (dilonode/train/checkpoint.py) write and what a joiner
fetches from its peers (dilonode/statesync/). It is captured only at a round boundary (no
fragment sync in flight), where every peer that took part in the same rounds holds the same
bytes. Inner AdamW moments and the local (inner) weights are deliberately not part of it:
see docs/architecture.md, "Joining a run in progress".

`config_digest(cfg)` names the settings that give these tensors their meaning (model,
effective outer algorithm, codec, seed); state made under another digest is refused.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dilonode.algo.outer import OuterState
from dilonode.algo.replay import EncodedResult
from dilonode.algo.schedule import SyncPlan
from dilonode.config import CodecConfig, RunConfig

__all__ = ["OuterCopy", "WorkerState", "adoption_step", "config_digest", "fragment_names",
           "reusable_fragments", "settled_step", "snapshot_error", "tensor_names"]


def config_digest(cfg: RunConfig) -> str:
    """sha256 hex of the settings the outer state depends on (not paths, steps or network)."""
    # step_seconds only proposes a clock; the swarm agrees on one whatever nodes propose.
    parts = {"model": _model_part(cfg),
             "diloco": cfg.diloco.effective().model_dump(mode="json",
                                                         exclude={"step_seconds"}),
             "codec": _codec_part(cfg), "seed": cfg.seed}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# Codec fields whose default leaves a config's digest as it is without them (checkpoints of
# dense runs without error feedback keep resuming).
_CODEC_DEFAULTS = {k: CodecConfig.model_fields[k].default
                   for k in ("kind", "topk_density", "error_feedback", "error_decay",
                             "error_store")}


def _codec_part(cfg: RunConfig) -> dict[str, object]:
    part = cfg.codec.model_dump(mode="json")
    for key, default in _CODEC_DEFAULTS.items():
        if part.get(key) == default:
            del part[key]
    return part


def _model_part(cfg: RunConfig) -> dict[str, object]:
    """The model settings; a local HF directory by its content (`model_identity`), not its
    path, and no path key at all for the other kinds (their digests stay as they were)."""
    part = cfg.model.model_dump(mode="json")
    part.pop("path", None)
    if cfg.model.kind == "hf":
        from dilonode.train.model import model_identity

        part["content"] = model_identity(cfg.model)
    return part


def settled_step(plan: SyncPlan, landed: list[int]) -> int:
    """The first step by whose end `plan` has landed the first `landed[p]` rounds of each
    fragment p (0 when none)."""
    return max((plan.start_step(p, n - 1) + plan.delay for p, n in enumerate(landed) if n),
               default=0)


def snapshot_error(plan: SyncPlan) -> str:
    """'' when the schedule has steps with no round in flight (checkpoints and the states
    joiners adopt are taken at those), else a one-line reason naming the fix."""
    widest = max(plan.start_gaps())
    if plan.delay < widest:
        return ""
    return (f"diloco.fragment_sync_delay = {plan.delay}: a round is always in flight with "
            f"sync_every = {plan.sync_every} and num_fragments = {plan.num_fragments}, so "
            f"no checkpoint and no state for joiners can be taken; use fewer than {widest}")


def adoption_step(plan: SyncPlan, landed: list[int]) -> int | None:
    """The latest step at which a worker following `plan` has landed exactly `landed[p]`
    rounds of each fragment p and has none in flight, or None if no step does (when tau is
    so long that some round is always in flight)."""
    hi = min(plan.start_step(p, n) for p, n in enumerate(landed)) - 1  # before a next start
    lo = settled_step(plan, landed)  # after the last landing
    return hi if 0 <= lo <= hi else None


def fragment_names(p: int) -> list[str]:
    """The tensors of fragment `p` in a state: its outer weights and outer momentum."""
    return [f"outer.{p}.weights", f"outer.{p}.momentum"]


def tensor_names(num_fragments: int) -> list[str]:
    """Tensor names of a state with `num_fragments` fragments, in canonical order."""
    return [name for p in range(num_fragments) for name in fragment_names(p)]


def reusable_fragments(reuse: WorkerState | None, rounds: list[int], outer_steps: list[int],
                       chains: list[str] | tuple[str, ...] | None = None) -> set[int]:
    """Fragments whose tensors in `reuse` (an earlier capture) are still current: the same
    rounds and outer steps (outer state moves only when a round lands) and, when both know
    them, the same chains (a grouped swarm's mixing round changes the state, no counter)."""
    if reuse is None:
        return set()
    ours = tuple(chains or ())
    compare = bool(ours) and len(reuse.chains) == len(ours)
    return {p for p, (r, n) in enumerate(zip(rounds, outer_steps, strict=True))
            if p < reuse.num_fragments and (reuse.rounds[p], reuse.outer_steps[p]) == (r, n)
            and (not compare or reuse.chains[p] == ours[p])}


@dataclass(frozen=True)
class OuterCopy:
    """A fragment's outer state as a node of several ranks gathers it for a capture (each
    rank holds a slice): the whole tensors on the leader, None where the capture reuses an
    earlier copy of them."""

    weights: torch.Tensor | None
    momentum_buf: torch.Tensor | None
    steps: int


@dataclass
class WorkerState:
    """Outer state after `rounds` landed rounds per fragment; `step` is the latest step at
    which a worker holds exactly that, with no sync in flight (`adoption_step`)."""

    step: int
    rounds: tuple[int, ...]  # per fragment: rounds started (= landed) by `step`
    outer_steps: tuple[int, ...]  # per fragment: outer steps applied (rounds minus refused)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> f32 CPU [numel_p]
    taken_at: int | None = None  # the exporting worker's own step (> `step` if in flight)
    # fragment p -> the results of its last landed rounds, oldest first, the last one that
    # of round rounds[p] - 1, consecutive: joiners holding (chunks of) the fragment a few
    # rounds old replay them (algo/replay.py); not checkpointed.
    replays: dict[int, tuple[EncodedResult, ...]] = field(default_factory=dict)
    # Per fragment, the hash chain of the rounds applied (algo/chain.py); () if unknown.
    chains: tuple[str, ...] = ()
    # fragment p -> the exporting worker's error-feedback residual [numel_p] (what it has
    # not sent yet, algo/error_feedback.py): its own debt, checkpointed, never served to
    # joiners (a joiner owes nothing); empty without error feedback.
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def capture(cls, step: int, rounds: list[int], outer: Sequence[OuterState | OuterCopy],
                reuse: WorkerState | None = None, taken_at: int | None = None,
                replays: dict[int, tuple[EncodedResult, ...]] | None = None,
                chains: list[str] | None = None,
                residuals: dict[int, torch.Tensor] | None = None) -> WorkerState:
        """A copy of `outer` (so training may go on while it is written or served).

        Fragments whose counters equal those in `reuse` (an earlier capture) have not changed
        since (outer state moves only when a round lands), so its tensors are shared instead
        of copied again."""
        tensors: dict[str, torch.Tensor] = {}
        keep = reusable_fragments(reuse, rounds, [st.steps for st in outer], chains)
        for p, st in enumerate(outer):
            if p in keep:
                for kind in ("weights", "momentum"):
                    tensors[f"outer.{p}.{kind}"] = reuse.tensors[f"outer.{p}.{kind}"]
                continue
            weights, momentum = st.weights, st.momentum_buf
            assert weights is not None and momentum is not None, \
                f"fragment {p} changed since `reuse` but was not gathered"
            tensors[f"outer.{p}.weights"] = weights.detach().to("cpu", copy=True)
            tensors[f"outer.{p}.momentum"] = momentum.detach().to("cpu", copy=True)
        return cls(step, tuple(rounds), tuple(st.steps for st in outer), tensors,
                   step if taken_at is None else taken_at, dict(replays or {}),
                   tuple(chains or ()), dict(residuals or {}))

    @property
    def num_fragments(self) -> int:
        return len(self.rounds)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def replay_rounds(self) -> list[tuple[int, int, EncodedResult]]:
        """(fragment, round, its result) for every result kept, fragment by fragment,
        oldest round first (the last of a fragment is round rounds[fragment] - 1)."""
        return [(p, self.rounds[p] - len(kept) + j, enc)
                for p, kept in sorted(self.replays.items()) for j, enc in enumerate(kept)]

    def meta(self) -> dict[str, object]:
        """The scalar part, JSON-ready."""
        return {"step": self.step, "rounds": list(self.rounds),
                "outer_steps": list(self.outer_steps), "chains": list(self.chains)}

    @classmethod
    def from_meta(cls, meta: dict[str, object], tensors: dict[str, torch.Tensor]) -> WorkerState:
        """Rebuild from `meta()` output and tensors; ValueError naming what is malformed."""
        step, rounds, outer_steps = meta.get("step"), meta.get("rounds"), meta.get("outer_steps")
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"state meta: step = {step!r} is not an integer >= 0")
        for name, seq in (("rounds", rounds), ("outer_steps", outer_steps)):
            if not isinstance(seq, list | tuple) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seq):
                raise ValueError(f"state meta: {name} = {seq!r} is not a list of integers >= 0")
        assert isinstance(rounds, list | tuple) and isinstance(outer_steps, list | tuple)
        if len(rounds) != len(outer_steps) or not rounds:
            raise ValueError(f"state meta: {len(rounds)} round counters but "
                             f"{len(outer_steps)} outer step counters")
        chains = meta.get("chains", [])
        if not isinstance(chains, list | tuple) or not all(
                isinstance(c, str) and re.fullmatch(r"[0-9a-f]{32}", c) for c in chains) \
                or len(chains) not in (0, len(rounds)):
            raise ValueError(f"state meta: chains = {str(chains)[:200]} is not one 32-hex "
                             "chain per fragment")
        state = cls(step, tuple(rounds), tuple(outer_steps), dict(tensors),
                    chains=tuple(chains))
        expected = set(tensor_names(len(rounds)))
        if set(tensors) != expected:
            raise ValueError(f"state tensors: got {sorted(tensors)}, expected {sorted(expected)}")
        return state

    def apply_to(self, outer: Sequence[OuterState]) -> None:
        """Copy into a worker's outer states; ValueError if the shapes do not match."""
        if len(outer) != self.num_fragments:
            raise ValueError(f"state has {self.num_fragments} fragments, this worker "
                             f"{len(outer)} (diloco.num_fragments differs)")
        for p, st in enumerate(outer):
            for kind, dst in (("weights", st.weights), ("momentum", st.momentum_buf)):
                src = self.tensors[f"outer.{p}.{kind}"]
                if src.shape != dst.shape or src.dtype != dst.dtype:
                    raise ValueError(f"state tensor outer.{p}.{kind}: {src.dtype} "
                                     f"{tuple(src.shape)} does not fit {dst.dtype} "
                                     f"{tuple(dst.shape)} (a different model?)")
        for p, st in enumerate(outer):
            self.apply_fragment(p, st)

    def apply_fragment(self, p: int, st: OuterState) -> None:
        """Copy fragment p's outer weights, momentum and step count into `st` (checked to
        fit by `apply_to`, or by the caller)."""
        st.weights.copy_(self.tensors[f"outer.{p}.weights"])
        st.momentum_buf.copy_(self.tensors[f"outer.{p}.momentum"])
        st.steps = self.outer_steps[p]
