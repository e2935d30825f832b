"""Regenerate the golden wire vectors in protocol/vectors/ (run on purpose only).

    .venv/bin/python protocol/make_vectors.py           # rewrite the vectors
    .venv/bin/python protocol/make_vectors.py --check   # exit 1 if they would change

Each vector is one frame (`<name>.bin`: 4-byte length + msgpack body) plus an entry in
`vectors.json` with the message's fields (payload as hex), and for chunk messages the float
values that were encoded (`input`) and what the payload decodes to (`decoded`), so another
implementation can check its framing and its codecs. Inputs are small exact binary
fractions, so the vectors do not depend on any RNG or libm. Changing a vector is a
protocol change: bump PROTOCOL_VERSION unless the old bytes still decode the same way.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from dilonode.algo.butterfly import reduce_weighted, weight_coefficients
from dilonode.algo.codecs import get_codec
from dilonode.allreduce.round import chunk_hash, group_digest, part_digest
from dilonode.wire.framing import encode_frame
from dilonode.wire.messages import (
    Abort,
    Contribution,
    Hello,
    HelloAck,
    HelloAuth,
    Message,
    Result,
    message_to_json,
)

__all__ = ["build_vectors", "main"]

VECTOR_DIR = Path(__file__).resolve().parent / "vectors"
_GROUP = group_digest(["peer-a", "peer-b", "peer-c", "peer-d"])
_ENVELOPE: dict[str, Any] = {"run_id": "golden-run", "fragment": 2, "round": 7, "attempt": 0,
                             "group": _GROUP}


def _pattern(start: int, n: int) -> bytes:
    """Placeholder bytes start, start+1, ... (mod 256)."""
    return bytes((start + i) % 256 for i in range(n))


def _values(numel: int, spread: int, denom: float) -> torch.Tensor:
    """Exactly representable test values: ((i * 7) mod spread - spread // 2) / denom."""
    i = torch.arange(numel, dtype=torch.int64)
    return (((i * 7) % spread) - spread // 2).to(torch.float32) / denom


def _chunk_vector(name: str, cls: type[Contribution] | type[Result], x: torch.Tensor,
                  codec_name: str, block_size: int, **fields: Any) -> dict[str, Any]:
    codec = get_codec(codec_name, block_size)
    payload, meta = codec.encode(x)
    decoded = codec.decode(payload, meta)
    if fields.pop("with_digest", False):
        fields["digest"] = part_digest([chunk_hash(decoded)])  # a one-chunk part
    msg = cls(**_ENVELOPE, **fields, numel=x.numel(), codec=codec_name, block_size=block_size,
              payload=payload)
    return {"name": name, "msg": msg, "input": x.tolist(), "decoded": decoded.tolist()}


def build_vectors() -> list[dict[str, Any]]:
    """The vectors as {name, msg, [input, decoded]} dicts, in a fixed order."""
    return [
        _chunk_vector("contribution_int4", Contribution, _values(100, 19, 4.0), "int4", 64,
                      sender=1, owner=0, chunk=1, n_chunks=3, offset=128, weight=30720.0),
        _chunk_vector("contribution_int8_odd", Contribution, _values(37, 255, 64.0), "int8",
                      16, sender=2, owner=1, chunk=0, n_chunks=1, offset=0, weight=0.0),
        _chunk_vector("result_float32_last", Result, _values(10, 9, 8.0), "float32", 64,
                      sender=0, owner=0, chunk=0, n_chunks=1, offset=0,
                      contributors=(0, 1, 2), with_digest=True),
        _chunk_vector("result_fp4_middle", Result, _values(20, 33, 16.0), "fp4", 8,
                      sender=1, owner=1, chunk=0, n_chunks=2, offset=0,
                      contributors=(0, 1)),
        _chunk_vector("contribution_int2", Contribution, _values(21, 9, 8.0), "int2", 8,
                      sender=3, owner=2, chunk=0, n_chunks=1, offset=0, weight=4096.0),
        _chunk_vector("contribution_sign1", Contribution, _values(27, 11, 16.0), "sign1", 16,
                      sender=0, owner=3, chunk=2, n_chunks=3, offset=512, weight=2048.0),
        _chunk_vector("result_int8_rejected", Result, _values(24, 31, 32.0), "int8", 8,
                      sender=2, owner=2, chunk=1, n_chunks=3, offset=48,
                      contributors=(0, 1, 2, 3), rejected=(3,)),
        # Top-k (section "Top-k payloads"): 5 kept values of a short chunk, as uint16
        # offsets (10 bytes < a 38-byte bitmap), then as a bitmap (5 bytes < 10); the
        # inputs repeat magnitudes, so the lower-index tie-break is pinned too.
        _chunk_vector("contribution_topk64_int2", Contribution, _values(300, 13, 8.0),
                      "topk64_int2", 8, sender=1, owner=0, chunk=0, n_chunks=1, offset=4096,
                      weight=1024.0),
        _chunk_vector("result_topk512_int4", Result, _values(40, 11, 4.0), "topk512_int4", 4,
                      sender=0, owner=0, chunk=0, n_chunks=1, offset=0,
                      contributors=(0, 1), with_digest=True),
        {"name": "abort", "msg": Abort(**{**_ENVELOPE, "attempt": 1}, sender=3,
                                       reason="member 3 gives up: peer 'peer-b' (member 1): "
                                              "connection closed", culprits=(1,))},
        {"name": "abort_no_group", "msg": Abort(**{**_ENVELOPE, "group": ""}, sender=0,
                                                reason="")},
        # Handshake vectors pin the encoding only: keys, nonces, signatures and MACs are
        # placeholder byte patterns, not valid cryptography.
        {"name": "hello", "msg": Hello(run_id="golden-run", peer_id="peer-a",
                                       public_key=_pattern(0x08, 40), nonce=_pattern(1, 32))},
        {"name": "hello_ack", "msg": HelloAck(run_id="golden-run", peer_id="peer-b",
                                              public_key=_pattern(0x18, 40),
                                              nonce=_pattern(2, 32),
                                              signature=_pattern(3, 64), mac=_pattern(4, 32))},
        {"name": "auth", "msg": HelloAuth(run_id="golden-run", signature=_pattern(5, 64),
                                          mac=_pattern(6, 32))},
        {"name": "hello_trust_mode", "msg": Hello(run_id="golden-run", peer_id="peer-c",
                                                  nonce=_pattern(7, 32))},
    ]


def build_reductions() -> list[dict[str, Any]]:
    """Owner reductions (protocol/README.md section 5, step 2): decoded inputs in member
    order, their token weights, the float32 coefficients and the exact float32 mean."""
    xs = [_values(8, 9, 8.0), _values(8, 13, 16.0) * 3, _values(8, 7, 4.0) / 5]
    out = []
    for name, weights in (("equal_weights", [7.0, 7.0, 7.0]),
                          ("token_weighted", [30720.0, 10240.0, 3072.0]),
                          ("one_zero_weight", [4096.0, 0.0, 4096.0 * 3])):
        coef = weight_coefficients(weights)
        out.append({"name": name, "weights": weights, "coefficients": coef,
                    "inputs": [x.tolist() for x in xs],
                    "mean": reduce_weighted(xs, weights).tolist()})
    return out


def _describe(vector: dict[str, Any]) -> dict[str, Any]:
    msg: Message = vector["msg"]
    entry = {"name": vector["name"], "file": f"{vector['name']}.bin",
             "fields": message_to_json(msg)}
    entry.update({k: vector[k] for k in ("input", "decoded") if k in vector})
    return entry


def render() -> dict[str, bytes]:
    """File name -> exact bytes of every file in protocol/vectors/."""
    vectors = build_vectors()
    files = {f"{v['name']}.bin": encode_frame(v["msg"]) for v in vectors}
    doc = {"protocol_version": vectors[0]["msg"].version,
           "vectors": [_describe(v) for v in vectors], "reductions": build_reductions()}
    files["vectors.json"] = (_dumps(doc) + "\n").encode()
    return files


def _dumps(doc: dict[str, Any]) -> str:
    """Indented JSON, but each list of numbers on one line so the file stays readable."""
    inline: dict[str, str] = {}
    for entry in doc["vectors"]:
        for key in ("input", "decoded"):
            if key in entry:
                tag = f"@@{entry['name']}.{key}@@"
                inline[json.dumps(tag)] = json.dumps(entry[key])
                entry[key] = tag
    text = json.dumps(doc, indent=1)
    for tag, values in inline.items():
        text = text.replace(tag, values)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    files = render()
    if args.check:
        stale = [n for n, data in files.items()
                 if not (VECTOR_DIR / n).is_file() or (VECTOR_DIR / n).read_bytes() != data]
        for name in stale:
            print(f"vector {name} differs from what make_vectors.py produces", file=sys.stderr)
        return 1 if stale else 0
    VECTOR_DIR.mkdir(exist_ok=True)
    for name, data in files.items():
        (VECTOR_DIR / name).write_bytes(data)
    print(f"wrote {len(files)} files to {VECTOR_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
