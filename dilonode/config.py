"""Configuration models for a dilonode run, one per component, and TOML loading.

Each component reads only its own model. The CLI loads a TOML file once, applies
`--set section.field=value` overrides, and hands the frozen `RunConfig` down. Invalid input
raises `ConfigError` whose message is one line per problem, naming field, value and rule.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from dilonode.algo.codec_table import (
    BLOCK_CODEC_NAMES,
    CODEC_NAMES,
    CODECS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CODEC,
)
from dilonode.algo.schedule import auto_merge_delay
from dilonode.net import congestion
from dilonode.net.auth import allowed_peer_id

# Values per all-reduce chunk (`NetworkConfig.chunk_numel`; `RoundPolicy` takes it too).
DEFAULT_CHUNK_NUMEL = 1 << 22

if TYPE_CHECKING:  # the config stays importable without torch (fast CLI start)
    from dilonode.algo.robust import AggregatorSpec

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "AggregatorConfig",
    "CheckpointConfig",
    "CodecConfig",
    "ConfigError",
    "DistConfig",
    "DataConfig",
    "DilocoConfig",
    "InnerOptConfig",
    "ModelConfig",
    "NetworkConfig",
    "AuthConfig",
    "PathsConfig",
    "RunConfig",
    "SimConfig",
    "StateSyncConfig",
    "StatusConfig",
    "SuperviseConfig",
    "load_config",
    "parse_overrides",
]


class ConfigError(ValueError):
    """A user-facing configuration problem; `str()` is one line per bad field."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)


class ModelConfig(_Frozen):
    """Which network to train."""

    kind: Literal["builtin", "factory", "hf_llama", "hf"] = Field(
        "builtin", description="builtin Llama-style decoder, a `module:function` factory, a "
        "transformers Llama from the preset, or a local HF model (`path`)")
    preset: Literal["nano", "tiny", "small", "150m", "1b"] = Field(
        "tiny", description="size preset for builtin/hf_llama; explicit fields below override it")
    factory: str | None = Field(
        None, description="`package.module:function` returning an nn.Module (kind=factory)")
    path: Path | None = Field(
        None, description="kind=hf: folder with config.json and *.safetensors (the run is named "
        "by content, not path)")
    vocab_size: int | None = Field(None, ge=2, description="vocabulary size (bytes: 256)")
    d_model: int | None = Field(None, ge=8, description="embedding width")
    n_layers: int | None = Field(None, ge=1, description="number of transformer blocks")
    n_heads: int | None = Field(None, ge=1, description="attention heads")
    ffn_hidden: int | None = Field(None, ge=8, description="SwiGLU hidden width")
    max_seq_len: int | None = Field(None, ge=8, description="longest sequence for rotary cache")
    tie_embeddings: bool = Field(True, description="share token embedding and output head")
    activation_checkpointing: bool = Field(
        False, description="recompute each block from its input in the backward pass: ~one "
        "block's activations, ~1/3 more compute")
    loss_chunk_tokens: int | Literal["auto"] = Field(
        "auto", description="tokens per loss chunk, so whole float32 logits never exist; 0: "
        "unchunked; auto: 1024 from an 8192-token vocabulary, else 0")
    compile: bool = Field(
        False, description="torch.compile the model (the first steps take longer)")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.kind == "hf" and self.path is None:
            raise ValueError("model.path = None: kind=hf needs a local Hugging Face model "
                             "directory")
        if self.kind == "factory" and (not self.factory or ":" not in self.factory):
            raise ValueError(f"model.factory = {self.factory!r}: kind=factory needs "
                             "'package.module:function'")
        if self.d_model is not None and self.n_heads is not None and self.d_model % self.n_heads:
            raise ValueError(f"model.d_model = {self.d_model}: must be divisible by "
                             f"model.n_heads = {self.n_heads}")
        return self


class DataConfig(_Frozen):
    """Where tokens come from and how batches are cut."""

    source: Literal["builtin", "text", "bin", "parquet", "arrow"] = Field(
        "builtin", description="embedded corpus, .txt/.jsonl folder, .bin token shards, Parquet "
        "file or folder, or `datasets` save_to_disk folder (the last two streamed)")
    path: Path | None = Field(None, description="folder or file for every source but builtin")
    bin_dtype: Literal["uint16", "uint32"] = Field("uint16", description="dtype of .bin tokens")
    tokenizer: str = Field(
        "bytes", description="'bytes' or a local tokenizer.json (it sets the vocabulary size)")
    jsonl_field: str = Field("text", description="field holding the text in .jsonl records")
    text_column: str = Field("text", description="source=parquet|arrow: the string column "
                             "holding each document's text")
    split: str = Field(
        "train", description="source=arrow with several splits (dataset_dict.json): the split to "
        "read")
    unit_rows: int = Field(
        4096, ge=1, description="parquet/arrow: rows per unit, the piece that workers divide, "
        "eval holds out and resume returns to")
    shard_index: int | None = Field(
        None, ge=0, description="this node's shard (with shard_count): shards never read the same "
        "unit in an epoch; unset: each worker starts the shared order elsewhere")
    shard_count: int | None = Field(
        None, ge=1, description="shards of the training data (the same on every node)")
    seq_len: int = Field(128, ge=2, description="tokens per training sequence")
    batch_size: int = Field(
        8, ge=1, description="sequences per inner step per worker, split evenly over a node's "
        "ranks")
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per forward/backward pass, accumulated into one AdamW "
        "update; unset: the rank's whole share")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="held-out share of tokens "
                                 "(parquet, arrow: of units, at least one)")
    eval_batches: int = Field(8, ge=1, description="batches per evaluation")
    seed: int = Field(
        0, description="seed of the unit order (parquet, arrow); each worker also mixes in its "
        "identity")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.source != "builtin" and self.path is None:
            raise ValueError(f"data.path = None: source={self.source} needs a path")
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(f"data.micro_batch_size = {self.micro_batch_size}: must divide "
                             f"data.batch_size = {self.batch_size}")
        if (self.shard_index is None) != (self.shard_count is None):
            unset = "shard_count" if self.shard_count is None else "shard_index"
            raise ValueError(f"data.{unset} = None: data.shard_index and data.shard_count "
                             "are set together or not at all")
        if self.shard_index is not None and self.shard_count is not None \
                and self.shard_index >= self.shard_count:
            raise ValueError(f"data.shard_index = {self.shard_index}: must be below "
                             f"data.shard_count = {self.shard_count}")
        return self


class InnerOptConfig(_Frozen):
    """AdamW, the optimizer every worker runs alone between syncs."""

    lr: float = Field(3e-3, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.1, ge=0.0, description="decoupled weight decay")
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="AdamW beta2")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    warmup_steps: int = Field(
        0, ge=0, description="linear warm-up, in reference steps, before the schedule")
    schedule: Literal["constant", "cosine", "wsd"] = Field(
        "constant", description="after warm-up: constant, cosine to min_lr_ratio * lr, or wsd "
        "(linear decay over the last decay_fraction), on the swarm clock")
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="where cosine and wsd end, as a share of lr")
    decay_fraction: float = Field(
        0.2, gt=0.0, le=1.0, description="wsd: the share of total_steps the decay takes")
    grad_clip: float = Field(1.0, ge=0.0, description="global norm clip; 0 disables")
    rewarm_steps: int = Field(
        20, ge=0, description="warm-up again after adopting a state with a fresh AdamW (join, "
        "resume); 0 disables")


def _int_or_auto(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return value
    raise ValueError("must be an integer >= 0 or 'auto'")


class DilocoConfig(_Frozen):
    """The outer algorithm: DDP, DiLoCo, or Streaming DiLoCo (names from the papers)."""

    mode: Literal["ddp", "diloco", "streaming"] = Field(
        "streaming", description="ddp: average gradients every step; diloco: P=1, tau=0, alpha=0; "
        "streaming: the fields below")
    sync_every: int = Field(30, ge=1, description="H: inner steps between syncs of a fragment")
    num_fragments: int = Field(3, ge=1, description="P: fragments synced on staggered offsets")
    fragment_pattern: Literal["strided", "sequential"] = Field(
        "strided", description="block i -> fragment i mod P (strided) or contiguous groups")
    fragment_sync_delay: Annotated[int | Literal["auto"], BeforeValidator(_int_or_auto)] = Field(
        1, description="tau: inner steps from a sync's start to its merge (pacing=time: the "
        "least, a later result merging on arrival); auto: half the gap between fragments' rounds")
    fragment_update_alpha: float = Field(
        0.5, ge=0.0, le=1.0, description="alpha: w <- alpha*w + (1-alpha)*g_new on merge")
    outer_lr: float = Field(0.7, gt=0.0, description="outer Nesterov SGD learning rate")
    outer_momentum: float = Field(0.9, ge=0.0, lt=1.0, description="outer SGD momentum")
    outer_nesterov: bool = Field(True, description="Nesterov momentum for the outer step")
    outer_lr_schedule: Literal["constant", "cosine", "wsd"] = Field(
        "constant", description="outer learning rate by each round's start step, shaped as "
        "inner.schedule, down to outer_min_lr_ratio")
    outer_min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="end of a decaying outer schedule, as a share of "
        "outer_lr")
    outer_state_on_cpu: bool = Field(
        True, description="keep global weights and outer momentum (float32) in host memory")
    pacing: Literal["time", "steps"] = Field(
        "time", description="time: rounds open on a shared swarm clock, so nodes of any speed "
        "meet; steps: every H own steps (equal speeds only)")
    step_seconds: float | None = Field(
        None, gt=0.0, description="pacing=time: seconds per reference step if this node starts "
        "the clock; unset: measured")
    min_round_seconds: float = Field(
        5.0, gt=0.0, description="pacing=time: least seconds between a fragment's rounds "
        "(matchmaking takes a second or two)")
    max_round_seconds: float = Field(
        3600.0, gt=0.0, description="pacing=time: most seconds between a fragment's rounds")
    retune_clock: bool = Field(
        True, description="pacing=time: slow the clock when rounds take over half a period on the "
        "links, speed it up when far less")
    final_sync: bool = Field(
        True, description="end with one round of every fragment trained since its last, so all "
        "nodes end equal")

    @model_validator(mode="after")
    def _check(self) -> DilocoConfig:
        if self.fragment_sync_delay == "auto" and self.pacing != "time":
            raise ValueError("diloco.fragment_sync_delay = 'auto': needs diloco.pacing = "
                             "'time' (paced by steps, tau is a fixed schedule)")
        if self.min_round_seconds > self.max_round_seconds:
            raise ValueError(f"diloco.min_round_seconds = {self.min_round_seconds}: must be <= "
                             f"diloco.max_round_seconds = {self.max_round_seconds}")
        tau, named = self.fragment_sync_delay, f"{self.fragment_sync_delay}"
        if tau == "auto":
            tau = auto_merge_delay(self.sync_every, self.num_fragments)
            named = f"'auto' ({tau})"
        if self.mode == "streaming" and tau >= self.sync_every:
            raise ValueError(
                f"diloco.fragment_sync_delay = {named}: must be < "
                f"diloco.sync_every = {self.sync_every} (a fragment's result must land before "
                "its next sync starts)")
        return self

    def effective(self) -> DilocoConfig:
        """The plan actually run: mode=diloco pins P=1, tau=0, alpha=0 (plain DiLoCo); tau
        'auto' is `auto_merge_delay(H, P)` (paced by the clock: a result merges at that
        many reference steps after its round's start, or when it arrives if later)."""
        if self.mode == "diloco":
            return self.model_copy(update={
                "num_fragments": 1, "fragment_sync_delay": 0, "fragment_update_alpha": 0.0})
        if self.fragment_sync_delay == "auto":
            return self.model_copy(update={"fragment_sync_delay": auto_merge_delay(
                self.sync_every, self.num_fragments)})
        return self


def _known_codec(value: str) -> str:
    if value not in CODECS:
        raise ValueError(f"must be one of {', '.join(CODEC_NAMES)}")
    return value


_DEFAULT_DENSITY = 0.03
# Values per top-k chunk (`algo.sparse.SPARSE_CHUNK`, which imports torch).
_TOPK_CHUNK = 4096


class CodecConfig(_Frozen):
    """How pseudo-gradients are quantized on the wire; sums are always float32."""

    name: Annotated[str, AfterValidator(_known_codec)] = Field(
        DEFAULT_CODEC, description=f"wire format of pseudo-gradient parts: "
        f"{', '.join(CODEC_NAMES)}", json_schema_extra={"enum": list(CODEC_NAMES)})
    block_size: int = Field(
        DEFAULT_BLOCK_SIZE, ge=2, le=1 << 20,
        description=f"values per absmax scale ({'/'.join(BLOCK_CODEC_NAMES)}); even, a "
        "multiple of 4 for int2 and of 8 for sign1")
    kind: Literal["dense", "randk", "topk"] = Field(
        "dense", description="dense: every value travels; randk: per chunk of "
        "`algo.sparse.SPARSE_CHUNK` values only topk_density of them, at positions every "
        "member draws alike from (run seed, fragment, round), in codec.name; topk: per chunk "
        "each node's own largest |x| with their positions, values in codec.name, and the "
        "owners send the largest of each sum back (docs/rounds.md)")
    topk_density: float = Field(
        _DEFAULT_DENSITY, gt=0.0, le=1.0,
        description="randk, topk: fraction of each chunk's values sent")
    error_feedback: bool = Field(
        False, description="keep what the codec (and randk or topk) did not send for the next "
        "round of the fragment, so the next pseudo-gradient owes it once (a residual per "
        "fragment, where error_store says; checkpointed; a joiner starts at 0)")
    error_decay: float = Field(
        1.0, gt=0.0, le=1.0, description="error_feedback: the residual kept is this times "
        "the part not sent (1: all of it; SparseLoCo's beta)")
    error_store: Literal["weights", "buffer"] = Field(
        "weights", description="error_feedback: where the residual waits. weights: the merge "
        "leaves it in the local weights (inner steps start that far off the global weights); "
        "buffer: beside them, added to the next pseudo-gradient, and the merge is the plain "
        "one (SparseLoCo's accumulator; needs diloco.fragment_update_alpha = 0)")

    @model_validator(mode="after")
    def _check(self) -> CodecConfig:
        per = CODECS[self.name].codes_per_byte
        if self.block_size % 2 or self.block_size % per:
            need = "even (two 4-bit values share a byte)" if per <= 2 else \
                f"a multiple of {per} for {self.name} ({per} values share a byte)"
            raise ValueError(f"codec.block_size = {self.block_size}: must be {need}")
        lossless = self.name == "float32" and self.kind == "dense"
        if self.error_feedback and lossless:
            raise ValueError("codec.error_feedback = true with codec.name = float32 and "
                             "codec.kind = dense: nothing is lost to feed back; use a lossy "
                             "codec or codec.kind = randk")
        if self.error_store != "weights" and not self.error_feedback:
            raise ValueError(f"codec.error_store = {self.error_store!r} needs "
                             "codec.error_feedback = true")
        if self.error_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"codec.error_decay = {self.error_decay} needs "
                             "codec.error_feedback = true")
        # (compared with the default, not "was it set": a config dump sets every field)
        if self.topk_density != _DEFAULT_DENSITY and self.kind == "dense":
            raise ValueError(f"codec.topk_density = {self.topk_density} needs "
                             "codec.kind = randk or topk (dense sends every value)")
        return self

    @property
    def wire_name(self) -> str:
        """The codec rounds speak: codec.name, or for topk `topk<k>_<codec.name>`
        (`algo.topk_codec`)."""
        if self.kind != "topk":
            return self.name
        from dilonode.algo.topk_codec import topk_name  # torch: not at config import
        return topk_name(self.name, self.topk_density)


class AggregatorConfig(_Frozen):
    """How part owners check and combine contributions, and when a peer is banned
    (dilonode/algo/robust.py). Every member of a run must use the same settings."""

    name: Literal["mean", "trimmed_mean", "centered_clip"] = Field(
        "mean", description="mean (the protocol's float32 mean), trimmed_mean, centered_clip")
    norm_bound: float = Field(
        0.0, ge=0.0, description="reject a chunk whose L2 norm exceeds this times the median; 0 "
        "disables (NaN/Inf always rejected)")
    trim: int = Field(1, ge=0, description="trimmed_mean: values dropped at each end")
    clip_tau: float = Field(
        1.0, gt=0.0, description="centered_clip: radius in median distances from the "
        "coordinate-wise median")
    clip_iters: int = Field(3, ge=1, le=100, description="centered_clip: iterations")
    max_weight_ratio: float = Field(
        16.0, ge=0.0, description="reject a contribution claiming over this times the round's "
        "median tokens (a speed ratio); 0: never")
    ban_after: int = Field(
        3, ge=0, description="ban a peer rejected in this many rounds within ban_window; 0: never")
    ban_window: float = Field(600.0, gt=0.0, description="seconds over which rejections count")
    ban_seconds: float = Field(300.0, gt=0.0, description="seconds a banned peer is left out")

    @model_validator(mode="after")
    def _check(self) -> AggregatorConfig:
        if 0 < self.max_weight_ratio < 1:
            raise ValueError(f"aggregator.max_weight_ratio = {self.max_weight_ratio}: must be "
                             "0 (off) or >= 1 (an honest median member must pass)")
        if 0 < self.norm_bound < 1:
            raise ValueError(f"aggregator.norm_bound = {self.norm_bound}: must be 0 (off) or "
                             ">= 1 (the median contribution itself must pass)")
        return self

    def spec(self) -> AggregatorSpec:
        """The pure algorithm's view of these settings."""
        from dilonode.algo.robust import AggregatorSpec

        return AggregatorSpec(name=self.name, norm_bound=self.norm_bound, trim=self.trim,
                              clip_tau=self.clip_tau, clip_iters=self.clip_iters,
                              max_weight_ratio=self.max_weight_ratio)


class NetworkConfig(_Frozen):
    """How a node reaches its peers (used by the swarm daemon)."""

    initial_peers: tuple[str, ...] = Field((), description="bootstrap multiaddrs")
    host: str = Field("127.0.0.1", description="address the DHT and data path listen on")
    port: int = Field(0, ge=0, le=65535, description="data path TCP port; 0 picks a free one")
    announce_host: str | None = Field(
        None, description="address peers dial for the data path (default: host); needed for "
        "0.0.0.0 or a NAT forward")
    dht_port: int = Field(0, ge=0, le=65535, description="DHT (libp2p) port; 0 picks one")
    identity_path: Path | None = Field(
        None, description="libp2p private key file: a stable peer id across restarts")
    matchmaking_window: float = Field(
        2.0, gt=0.0, description="seconds a round waits for peers not yet registered")
    matchmaking_timeout: float = Field(10.0, gt=0.0, description="seconds to form a group")
    allreduce_timeout: float = Field(30.0, gt=0.0, description="seconds per all-reduce attempt")
    max_attempts: int = Field(3, ge=1, le=10, description="attempts per round before skipping")
    chunk_numel: int = Field(
        DEFAULT_CHUNK_NUMEL, ge=64, description="most values per pipelined chunk; parts are cut "
        "into 3 chunks of at least min(262,144, this); must match across a group")
    tcp_congestion: str = Field(
        "auto", pattern=congestion.NAME_PATTERN, description="TCP congestion control of data and "
        "state connections: a kernel name, 'system', or 'auto' (per connection: bbr from a "
        "20 ms round trip on, where cubic falls far short of the line rate; cubic below, as "
        "bbr resends in all-to-all rounds; docs/reports/2026-12-04-congestion-rtt.md)")
    socket_buffer_bytes: Annotated[int | Literal["auto"], BeforeValidator(_int_or_auto)] = Field(
        "auto", description="send and receive buffer of each data-plane connection, bytes "
        "(0: the kernel's autotuning); 'auto': 2 x bandwidth_mbps x 500 ms, 4-64 MiB, the "
        "bandwidth-delay product of a 500 ms round trip twice over")
    bandwidth_mbps: float = Field(
        100.0, gt=0.0, description="advertised bandwidth, weighting this node's share of round "
        "traffic (a slower measured link lowers it)")
    min_peers: int = Field(
        1, ge=1, description="wait until this many peers (self included) are visible to start")
    start_timeout: float = Field(120.0, gt=0.0, description="longest wait for min_peers")
    max_clock_offset: float = Field(
        3600.0, gt=0.0, description="most seconds this clock may be off its initial DHT peers' "
        "before the node stops")
    peer_ttl: float = Field(15.0, gt=1.0, description="seconds a published peer record lives")
    p2p_fallback: bool = Field(
        True, description="relay frames over libp2p streams when a peer's data address is "
        "unreachable (NAT; more CPU)")
    reachable: Literal["auto", "public", "private"] = Field(
        "auto", description="private: behind NAT without a forward (DHT client, relay slots at "
        "the initial peers, data and state over libp2p streams); auto: private on a non-global "
        "address without announce_host when an initial peer is global")
    leave_timeout: float = Field(
        5.0, gt=0.0, description="seconds a stopping node waits for in-flight rounds (never "
        "half-applied)")
    max_group_size: int = Field(
        16, ge=2, le=64, description="most peers in one fragment round; larger swarms split into "
        "groups that change every round")
    mix_state_every: int = Field(
        1, ge=0, le=1000, description="grouped swarms: a group also averages its float32 outer "
        "state every n-th round; 0: never (replicas drift)")
    final_mix_rounds: int = Field(
        3, ge=0, le=64, description="grouped swarms: end-of-run rounds averaging outer states in "
        "rotating groups")

    @model_validator(mode="after")
    def _check(self) -> NetworkConfig:
        if self.host in ("0.0.0.0", "::") and not self.announce_host:
            raise ValueError(f"network.host = {self.host!r}: peers cannot dial a wildcard "
                             "address; set network.announce_host to this machine's address")
        if self.matchmaking_timeout <= self.matchmaking_window:
            raise ValueError(f"network.matchmaking_timeout = {self.matchmaking_timeout}: must "
                             f"be > network.matchmaking_window = {self.matchmaking_window}")
        return self


class AuthConfig(_Frozen):
    """Who may join the run: a shared swarm secret and/or an allowlist of peer identities.

    With neither the run is open, but every peer still proves the peer id it claims (data
    plane handshake, signed DHT records). The secret itself is never in the config (so it is
    never logged or written out): only where to read it, by `dilonode run`.
    """

    secret_file: Path | None = Field(
        None, description="file holding the swarm secret (>= 16 bytes, e.g. `head -c 32 "
        "/dev/urandom | base64`)")
    secret_env: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="environment variable holding the swarm secret, instead of secret_file")
    allowed_peers: tuple[str, ...] | None = Field(
        None, description="peer ids or base64 public keys admitted (`dilonode identity KEYFILE`); "
        "unset: anyone with the secret")

    @model_validator(mode="after")
    def _check(self) -> AuthConfig:
        if self.secret_file is not None and self.secret_env is not None:
            raise ValueError("auth.secret_env: set either auth.secret_file or "
                             "auth.secret_env, not both")
        for entry in self.allowed_peers or ():
            try:
                allowed_peer_id(entry)
            except ValueError as exc:
                raise ValueError(f"auth.allowed_peers: {exc}") from None
        return self

    def allowed(self) -> frozenset[str] | None:
        """The allowlist as peer ids (None: no allowlist)."""
        if self.allowed_peers is None:
            return None
        return frozenset(allowed_peer_id(e) for e in self.allowed_peers)


class StatusConfig(_Frozen):
    """The read-only HTTP status endpoint (JSON, Prometheus metrics, dashboard) of a node."""

    enabled: bool = Field(True, description="serve /status, /metrics and the dashboard")
    host: str = Field("127.0.0.1", description="listen address; expose it deliberately")
    port: int = Field(0, ge=0, le=65535, description="listen port; 0 picks a free one")
    history: int = Field(600, ge=10, le=100_000, description="points kept for the charts")
    peak_tflops: float = Field(
        0.0, ge=0.0, description="dense bf16 TFLOP/s of one device, for MFU; 0: looked up by "
        "device name")


class AdmissionConfig(_Frozen):
    """Caps on incoming connections of the data, state-sync and status ports, and on the
    log lines peers can cause (dilonode/net/admission.py, dilonode/net/peer_log.py)."""

    raise_nofile: bool = Field(
        True, description="at start, raise the soft open-files limit to the hard limit")
    fd_reserve: int = Field(
        0, ge=0, description="descriptors kept from incoming connections; 0: a quarter of the "
        "limit, at least 256")
    max_open: int = Field(
        0, ge=0, description="connections held at once per port; 0: sized from the "
        "open-files limit")
    max_pending: int = Field(
        0, ge=0, description="connections in their handshake per port; 0: sized from the "
        "open-files limit")
    max_pending_per_source: int = Field(
        32, ge=1, description="connections still in their handshake per port from one address")
    log_interval: float = Field(
        60.0, gt=0.0, description="seconds between summaries of repeated peer-caused events (each "
        "address's first in full)")


class SuperviseConfig(_Frozen):
    """How a node watches its own parts (DHT process and p2pd, data plane listener, state
    server, status server) and re-finds its swarm after a partition (dilonode/node/supervisor.py).

    A part that fails its health check is restarted in place, one part at a time, with
    exponential backoff; one that stays down longer than `give_up_after`, or goes down more
    than `max_outages` times within `outage_window`, makes the node write a checkpoint and
    exit non-zero with a one-line reason (systemd's Restart=on-failure then starts it
    afresh)."""

    enabled: bool = Field(True, description="supervise the node's parts (off: a dead part "
                          "goes unnoticed)")
    check_interval: float = Field(
        2.0, gt=0.0, description="seconds between two health checks of every part")
    check_timeout: float = Field(
        5.0, gt=0.0, description="seconds a part has to answer a health check")
    unanswered_checks: int = Field(
        2, ge=1, description="timed-out checks in a row before a part counts as down (a dead "
        "process counts at once)")
    restart_timeout: float = Field(
        45.0, gt=0.0, description="seconds one restart may take (a DHT restart re-bootstraps)")
    backoff_initial: float = Field(
        1.0, gt=0.0, description="seconds before a part's second restart, doubled after each "
        "failure")
    backoff_max: float = Field(30.0, gt=0.0, description="longest wait between restarts")
    give_up_after: float = Field(
        120.0, gt=0.0, description="seconds a part may stay down before the node checkpoints and "
        "exits non-zero")
    max_outages: int = Field(
        5, ge=1, description="outages of one part within outage_window the node rides out")
    outage_window: float = Field(300.0, gt=0.0, description="seconds max_outages counts over")
    exit_grace: float = Field(
        60.0, gt=0.0, description="seconds to stop cleanly after giving up before a hard exit "
        "(code 1)")
    remerge: bool = Field(
        True, description="when fewer peers are live than recently, re-contact initial and "
        "remembered peers")
    remember_for: float = Field(
        600.0, gt=0.0, description="seconds a peer not seen live is still looked for")
    remerge_backoff_max: float = Field(
        30.0, gt=0.0, description="longest wait between two re-contact attempts")
    alone_warn_rounds: int = Field(
        3, ge=1, description="rounds alone in a row, with other peers live, before the node warns")
    alone_log_every: float = Field(
        60.0, gt=0.0, description="seconds between two repeats of the 'alone' warning log")

    @model_validator(mode="after")
    def _check(self) -> SuperviseConfig:
        if self.backoff_max < self.backoff_initial:
            raise ValueError(f"supervise.backoff_max = {self.backoff_max}: must be >= "
                             f"supervise.backoff_initial = {self.backoff_initial}")
        if self.give_up_after <= self.check_timeout:
            raise ValueError(f"supervise.give_up_after = {self.give_up_after}: must be > "
                             f"supervise.check_timeout = {self.check_timeout}")
        return self


class CheckpointConfig(_Frozen):
    """Periodic local checkpoints of the outer state (dilonode/train/checkpoint.py)."""

    dir: Path | None = Field(
        None, description="checkpoint folder (default: paths.checkpoint_dir, else out_dir/ckpt)")
    every_steps: int = Field(
        1000, ge=0, description="inner steps between background checkpoints; 0 disables")
    keep: int = Field(3, ge=1, le=1000, description="newest checkpoints kept on disk")
    on_exit: bool = Field(True, description="also write one when the node stops cleanly")


class StateSyncConfig(_Frozen):
    """Live state recovery: serve our outer state to joiners, fetch it when we join."""

    enabled: bool = Field(
        True, description="serve state to joiners; on start, recover from live peers ahead of us")
    host: str | None = Field(None, description="listen address (default: network.host)")
    port: int = Field(0, ge=0, le=65535, description="state TCP port; 0 picks a free one")
    chunk_bytes: int = Field(
        1 << 20, ge=4096, le=64 << 20, description="bytes per verified chunk")
    window: int = Field(4, ge=1, le=64, description="chunk requests in flight per peer")
    request_timeout: float = Field(
        20.0, gt=0.0, description="seconds for one request (manifest or chunk) to be answered")
    recover_timeout: float = Field(
        600.0, gt=0.0, description="longest a joiner spends recovering before it gives up")
    snapshot_wait: float = Field(
        5.0, gt=0.0, description="seconds a server waits for a round boundary to snapshot")
    max_passes: int = Field(
        6, ge=1, le=100, description="fetches that fail to catch a moving state before our record "
        "is published anyway")
    replay_rounds: int = Field(
        16, ge=0, le=256, description="per fragment, recent round results kept for joiners to "
        "replay instead of refetching; 0: none")

    @model_validator(mode="after")
    def _check(self) -> StateSyncConfig:
        if self.request_timeout <= self.snapshot_wait:
            raise ValueError(f"statesync.request_timeout = {self.request_timeout}: must be > "
                             f"statesync.snapshot_wait = {self.snapshot_wait} (a manifest "
                             "request may wait that long for a snapshot)")
        return self


class PathsConfig(_Frozen):
    """Where a run writes logs, plots and checkpoints."""

    out_dir: Path = Field(Path("runs/default"), description="logs, JSON/CSV metrics, plots")
    checkpoint_dir: Path | None = Field(None, description="checkpoints (default out_dir/ckpt)")
    trace: bool = Field(
        False, description="log every round started and landed to out_dir/trace.jsonl")


class SimConfig(_Frozen):
    """In-process simulation of M workers."""

    workers: int = Field(4, ge=1, le=256, description="M: virtual workers")
    speeds: tuple[float, ...] | None = Field(
        None, description="relative speed per worker on a virtual clock (0.25: four times "
        "slower); unset: lockstep")
    latency: float = Field(
        0.0, ge=0.0, description="virtual seconds from a round's last contribution to its result "
        "arriving")

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if self.speeds is not None:
            if len(self.speeds) != self.workers:
                raise ValueError(f"sim.speeds: {len(self.speeds)} given for sim.workers = "
                                 f"{self.workers}")
            if not all(0 < v <= 1000 and v == v for v in self.speeds):
                raise ValueError(f"sim.speeds = {list(self.speeds)}: each must be in (0, 1000]")
        return self


class DistConfig(_Frozen):
    """Training inside one node on several local devices (dilonode/train/ranks/node_ranks.py): N
    ranks, one per device, synchronous inner steps, one peer to the swarm."""

    nproc: int = Field(
        1, ge=1, le=256, description="ranks of this node, one per device (`--nproc N` or "
        "torchrun's world size)")
    strategy: Literal["auto", "ddp", "fsdp"] = Field(
        "auto", description="ddp: a replica per rank; fsdp: FSDP2 per block; auto: ddp if the "
        "training state fits one device")
    timeout: float = Field(
        600.0, gt=0.0, description="seconds an in-node collective may take before the node stops")
    share_codec: bool = Field(
        True, description="ranks encode their slices in parallel, the leader sends them (CPU "
        "nodes)")
    stop_grace: float = Field(
        20.0, gt=0.0, description="seconds rank 0 gets to leave the swarm after another rank died")


class RunConfig(_Frozen):
    """Everything one run needs; each component receives only its own section."""

    run_id: str = Field("dilonode-default", min_length=1, max_length=128,
                        pattern=r"^[A-Za-z0-9._-]+$", description="swarm run identifier")
    seed: int = Field(0, description="seed for model init (identical on every worker)")
    total_steps: int = Field(
        300, ge=1, description="run length in reference steps: own inner steps (pacing=steps) or "
        "swarm clock steps (pacing=time)")
    eval_every: int = Field(50, ge=1, description="inner steps between evaluations")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="cuda with bf16 autocast when available, else cpu")
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerOptConfig = InnerOptConfig()
    diloco: DilocoConfig = DilocoConfig()
    codec: CodecConfig = CodecConfig()
    aggregator: AggregatorConfig = AggregatorConfig()
    network: NetworkConfig = NetworkConfig()
    auth: AuthConfig = AuthConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    statesync: StateSyncConfig = StateSyncConfig()
    status: StatusConfig = StatusConfig()
    admission: AdmissionConfig = AdmissionConfig()
    supervise: SuperviseConfig = SuperviseConfig()
    paths: PathsConfig = PathsConfig()
    sim: SimConfig = SimConfig()
    dist: DistConfig = DistConfig()

    @model_validator(mode="after")
    def _check_ranks(self) -> RunConfig:
        n = self.dist.nproc
        c = self.codec
        if (c.kind != "dense" or c.error_feedback) and (n > 1 or self.diloco.mode == "ddp"):
            what = f"codec.kind = {c.kind}" if c.kind != "dense" else \
                "codec.error_feedback = true"
            where = f"dist.nproc = {n}" if n > 1 else "diloco.mode = ddp"
            raise ValueError(f"{what} with {where}: sparse rounds and error feedback work on "
                             "a one-rank node's fragment rounds only")
        if c.kind == "topk" and (why := _topk_problem(self)) is not None:
            raise ValueError(why)
        alpha = self.diloco.effective().fragment_update_alpha
        if c.error_feedback and c.error_store == "buffer" and alpha > 0:
            # Measured to diverge (docs/reports/2026-12-04-error-buffer.md).
            raise ValueError(f"codec.error_store = 'buffer' with diloco.fragment_update_alpha "
                             f"= {alpha}: the merge keeps alpha of the unsent part in the "
                             "local weights while the buffer holds it too, so it is owed "
                             "again every round; use alpha = 0 or codec.error_store = "
                             "'weights'")
        if n > 1 and self.diloco.mode == "ddp":
            raise ValueError(f"dist.nproc = {n}: diloco.mode = ddp averages every gradient "
                             "with the swarm; use streaming or diloco with several ranks")
        if self.data.batch_size % n:
            raise ValueError(f"data.batch_size = {self.data.batch_size}: the node's batch is "
                             f"split over dist.nproc = {n} ranks, so it must be a multiple "
                             f"of {n}")
        return self


def _topk_problem(cfg: RunConfig) -> str | None:
    """Why codec.kind = topk cannot run with the rest of cfg, or None."""
    agg = cfg.aggregator.name
    if agg != "mean":
        return (f"codec.kind = topk with aggregator.name = {agg}: members keep different "
                "positions, so a robust rule would compare values with zeros; use "
                "aggregator.name = mean or codec.kind = randk")
    chunk = cfg.network.chunk_numel
    if chunk % _TOPK_CHUNK:
        return (f"codec.kind = topk with network.chunk_numel = {chunk}: must be a multiple "
                f"of {_TOPK_CHUNK} (the top-k chunk) so that no chunk straddles two frames")
    return None


def _format_errors(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if loc and not msg.startswith(loc):
            got = e.get("input")
            got_s = "" if isinstance(got, dict) else f" = {got!r}"
            msg = f"{loc}{got_s}: {msg}"
        lines.append(f"config error ({source}): {msg}")
    return "\n".join(lines)


def _parse_value(text: str) -> Any:
    """TOML-ish scalar parsing for `--set a.b=value` (numbers, bools, lists, else string)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ['diloco.sync_every=50', ...] into a nested dict."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"config error (--set): {item!r}: expected section.field=value")
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config error (--set): {key!r}: {part} is not a section")
        node[parts[-1]] = _parse_value(value.strip())
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(path: str | Path | None = None,
                overrides: dict[str, Any] | None = None) -> RunConfig:
    """Load a TOML file (or defaults), apply overrides, validate; ConfigError on any problem."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        source = str(path)
        try:
            text = Path(path).read_text()
            # JSON is what `dilonode swarm` hands its child nodes (a RunConfig dump).
            data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        except FileNotFoundError:
            raise ConfigError(f"config error: {path}: no such file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config error ({path}): not valid TOML: {exc}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"config error ({path}): not valid JSON: {exc}") from None
    if overrides:
        data = _merge(data, overrides)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, source)) from None
