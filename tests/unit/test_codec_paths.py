"""Every implementation of the codecs and of the owner's reduction gives the same bits.

Three codec implementations: the numpy/torch reference (`get_codec(reference=True)`), the
compiled kernels (the default) and the device codecs of `torch_codecs.py` (run here on the
CPU; on a GPU by the CUDA tests at the end, skipped without one). Two round data paths:
host and torch (`allreduce/datapath.py`), checked against each other, `butterfly_average`
and the golden vectors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dilonode.algo import kernels
from dilonode.algo.butterfly import (
    butterfly_average,
    reduce_weighted,
    reduction_steps,
    weight_coefficients,
)
from dilonode.algo.codec_table import CODEC_NAMES, CODECS, FLOAT_CODEC_NAMES
from dilonode.algo.codecs import CodecError, CodecMeta, get_codec
from dilonode.algo.torch_codecs import decode_torch, encode_chunks_torch, encode_torch
from dilonode.allreduce.datapath import HostPath, TorchPath, chunk_hash
from dilonode.allreduce.memnet import MemNet
from dilonode.allreduce.round import AllReduceRound, Done, GroupSpec, group_digest

VECTORS = Path(__file__).resolve().parents[2] / "protocol" / "vectors" / "vectors.json"
STEPS = [("write", 1.0), ("add", 1.0), ("write_scaled", 0.3), ("add_scaled", 0.7),
         ("add_divide", 3.0)]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().cpu().contiguous().view(torch.int32).tolist()


def _u8(data: bytes, device: str = "cpu") -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8, device=device)


def _inputs(name: str) -> st.SearchStrategy[np.ndarray]:
    """float32 vectors over many magnitudes, with zero runs, -0.0 and exact ties."""
    bound = float(np.float32(6e4 if name == "float16" else 3e38))
    tiny = float(np.float32(1e-40))  # subnormal
    elems = st.one_of(st.floats(-bound, bound, width=32),
                      st.sampled_from([0.0, -0.0, 0.5, -1.5, 2.5, 7.0, tiny]))
    return arrays(np.float32, st.integers(0, 300), elements=elems)


def _block_size(name: str) -> st.SearchStrategy[int]:
    if name in FLOAT_CODEC_NAMES:
        return st.just(64)
    per = CODECS[name].codes_per_byte
    return st.sampled_from([b for b in ([2, 4, 8, 64] if name != "int8" else [2, 3, 64])
                            if b % per == 0])


# ------------------------------------------------------------------ codecs, bit for bit


@pytest.mark.parametrize("name", CODEC_NAMES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_kernels_torch_and_reference_codecs_agree(name: str, data: st.DataObject) -> None:
    arr = data.draw(_inputs(name))
    bs = data.draw(_block_size(name))
    x = torch.from_numpy(arr)
    ref, fast = get_codec(name, bs, reference=True), get_codec(name, bs)
    try:
        expected, meta = ref.encode(x)
    except CodecError:  # float16 overflow: every implementation refuses
        with pytest.raises(CodecError):
            fast.encode(x)
        with pytest.raises(CodecError):
            encode_torch(fast, x)
        return
    assert fast.encode(x)[0] == expected
    assert bytes(encode_torch(fast, x).numpy()) == expected
    values = ref.decode(expected, meta)
    assert _bits(fast.decode(expected, meta)) == _bits(values)
    assert _bits(decode_torch(fast, _u8(expected), meta)) == _bits(values)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("step,coef", STEPS)
def test_accumulate_is_decode_then_the_torch_step(name: str, step: str, coef: float) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1000, generator=gen)
    start = torch.randn(1000, generator=gen)
    for codec in (get_codec(name, 64), get_codec(name, 64, reference=True)):
        data, meta = codec.encode(x)
        v = codec.decode(data, meta)
        expected = {"write": v.clone(), "add": start + v, "write_scaled": v * coef,
                    "add_scaled": start + v * coef, "add_divide": (start + v) / coef}[step]
        got = start.clone()
        codec.accumulate(data, meta, got, step, coef)
        assert _bits(got) == _bits(expected)


@pytest.mark.parametrize("name", ("int8", "int4", "fp4", "float32", "bfloat16"))
def test_chunked_device_encoding_is_the_chunks_encodings(name: str) -> None:
    codec = get_codec(name, 64)
    x = torch.randn(64 * 40 + 17, generator=torch.Generator().manual_seed(2))
    for chunk in (64, 640, 64 * 40, 64 * 41):
        expected = b"".join(codec.encode(x[i:i + chunk])[0] for i in range(0, x.numel(), chunk))
        assert bytes(encode_chunks_torch(codec, x, chunk).numpy()) == expected


def test_golden_payloads_through_every_implementation() -> None:
    doc = json.loads(VECTORS.read_text())
    seen = set()
    for vec in doc["vectors"]:
        fields = vec["fields"]
        if "input" not in vec:
            continue
        payload = bytes.fromhex(fields["payload"])
        meta = CodecMeta(fields["codec"], fields["numel"], fields["block_size"])
        x = torch.tensor(vec["input"], dtype=torch.float32)
        for codec in (get_codec(meta.codec, meta.block_size),
                      get_codec(meta.codec, meta.block_size, reference=True)):
            assert codec.encode(x)[0] == payload
            assert codec.decode(payload, meta).tolist() == vec["decoded"]
            assert bytes(encode_torch(codec, x).numpy()) == payload
            assert decode_torch(codec, _u8(payload), meta).tolist() == vec["decoded"]
        seen.add(meta.codec)
    assert seen >= {"int4", "int8", "float32", "fp4"}


def _small_block(name: str) -> int:
    return max(4, CODECS[name].codes_per_byte)


def _corrupt(name: str) -> list[tuple[bytes, CodecMeta]]:
    codec = get_codec(name, _small_block(name))
    x = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])
    data, meta = codec.encode(x)
    bad = []
    if name in FLOAT_CODEC_NAMES:
        nan = np.array([np.nan], dtype=np.float32 if name == "float32" else np.float16)
        if name == "bfloat16":
            nan = np.array([0x7FC0], dtype="<u2")
        bad.append((nan.tobytes() + data[len(nan.tobytes()):], meta))
    else:
        bad.append((np.array([-1.0], "<f4").tobytes() + data[4:], meta))
        bad.append((np.array([np.inf], "<f4").tobytes() + data[4:], meta))
        body = bytearray(data)
        if name == "int8":
            body[8] = 0x80  # -128
            bad.append((bytes(body), meta))
        else:
            body[-1] |= 0xF0  # padding nibble (codes, bits) after the last value
            bad.append((bytes(body), meta))
            if name in ("int4", "int2"):
                body = bytearray(data)
                body[8] = 0x08 if name == "int4" else 0x02  # -8 / -2: outside the range
                bad.append((bytes(body), meta))
    bad.append((data[:-1], meta))
    return bad


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_implementation_refuses_bad_payloads_alike(name: str) -> None:
    for data, meta in _corrupt(name):
        bs = _small_block(name)
        with pytest.raises(CodecError) as ref_err:
            get_codec(name, bs, reference=True).decode(data, meta)
        with pytest.raises(CodecError) as fast_err:
            get_codec(name, bs).check(data, meta)
        with pytest.raises(CodecError) as dev_err:
            decode_torch(get_codec(name, bs), _u8(data), meta)
        assert str(fast_err.value) == str(dev_err.value) == str(ref_err.value)


@pytest.mark.parametrize("name", CODEC_NAMES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_every_implementation_refuses_non_finite_input(name: str, bad: float) -> None:
    x = torch.ones(130)
    x[129] = bad
    for encode in (get_codec(name, 64).encode, get_codec(name, 64, reference=True).encode,
                   lambda t: encode_torch(get_codec(name, 64), t)):
        with pytest.raises(CodecError):
            encode(x)


def test_kernels_are_compiled_here() -> None:
    """CI installs numba: the default codecs must take the compiled path."""
    assert kernels.AVAILABLE and get_codec("int4").fast  # type: ignore[attr-defined]


# ------------------------------------------------------------------ the owner's reduction


def _reduction_cases() -> list[tuple[list[list[float]], list[float]]]:
    doc = json.loads(VECTORS.read_text())
    cases = [(r["inputs"], r["weights"]) for r in doc["reductions"]]
    gen = torch.Generator().manual_seed(9)
    for weights in ([1.0, 1.0, 1.0], [3.0, 1.0, 5.5], [2.0], [1.0, 0.0, 4.0, 4.0]):
        cases.append(([torch.randn(257, generator=gen).tolist() for _ in weights], weights))
    return cases


@pytest.mark.parametrize("case", range(len(_reduction_cases())))
def test_reduction_steps_reproduce_reduce_weighted(case: int) -> None:
    inputs, weights = _reduction_cases()[case]
    xs = [torch.tensor(x, dtype=torch.float32) for x in inputs]
    expected = _bits(reduce_weighted(xs, weights))
    steps = reduction_steps(weights, len(xs))
    if weight_coefficients(weights) is None:
        assert [s for s, _ in steps][-1:] == ["add_divide" if len(xs) > 1 else "write"]
    codec = get_codec("float32")
    host = HostPath(codec, torch.zeros(1))
    payloads = [x.numpy().tobytes() for x in xs]
    assert _bits(host.combine(payloads, steps, torch.empty(len(inputs[0])))) == expected
    dev = TorchPath(codec, torch.zeros(1))
    assert _bits(dev.combine(xs, steps, torch.empty(len(inputs[0])))) == expected


def _round_results(xs: list[torch.Tensor], codec: str, weights: list[float], path: str,
                   chunk_numel: int = 256) -> tuple[list[torch.Tensor], set[str]]:
    members = tuple(f"peer-{i}" for i in range(len(xs)))
    spec = GroupSpec(run_id="paths", fragment=0, round=1, members=members,
                     weights=(1.0, 1.0, 2.0)[:len(xs)], numel=xs[0].numel(), codec=codec,
                     block_size=64, chunk_numel=chunk_numel,
                     group_digest=group_digest(members))
    rounds = [AllReduceRound(spec, i, x, weight=w, data_path=path)
              for i, (x, w) in enumerate(zip(xs, weights, strict=True))]
    outcomes = MemNet(rounds, start=1.0).run()
    assert all(isinstance(o, Done) for o in outcomes.values()) and len(outcomes) == len(xs)
    return [r.result for r in rounds], {r.digest for r in rounds}


@pytest.mark.parametrize("codec", ["float32", "bfloat16", "int8", "int4", "fp4"])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [2.0, 7.0, 3.0]])
def test_host_and_torch_paths_give_the_same_round(codec: str, weights: list[float]) -> None:
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(3001, generator=gen) for _ in weights]  # N = 3: a real division
    host, host_digests = _round_results(xs, codec, weights, "host")
    dev, dev_digests = _round_results(xs, codec, weights, "torch")
    assert len(host_digests) == 1 and host_digests == dev_digests
    expected, _, _ = butterfly_average(xs, [1.0, 1.0, 2.0], get_codec(codec, 64),
                                       chunk_numel=256, align=64, token_weights=weights)
    for got in host + dev:
        assert _bits(got) == _bits(expected)


@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_torch_path_hashes_a_large_chunk_as_the_host_path(codec: str) -> None:
    # 2 MiB of values: the torch path hashes them on every core (float32 from the payload).
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    x = torch.randn(1 << 19, generator=torch.Generator().manual_seed(5))
    host = HostPath(get_codec(codec, 64), x)
    payload = host.encode(x)
    values = torch.empty_like(x)
    host.decode_into(payload, host.meta(x.numel()), values)
    expected = chunk_hash(values)
    assert host.hash_chunk(values, payload) == expected
    for device in devices:
        dev = TorchPath(get_codec(codec, 64), x.to(device))
        assert dev.hash_chunk(values.to(device), payload) == expected


# ------------------------------------------------------------------ on a GPU


@needs_cuda
@pytest.mark.parametrize("name", CODEC_NAMES)
def test_cuda_codecs_match_the_cpu_reference(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    ref = get_codec(name, 64, reference=True)
    for n in (1, 63, 64, 1001, 262_144 + 3):
        x = torch.randn(n, generator=gen) * torch.exp(3 * torch.randn(n, generator=gen))
        if name == "float16":
            x = x.clamp(-6e4, 6e4)
        expected, meta = ref.encode(x)
        got = encode_torch(ref, x.cuda())
        assert got.device.type == "cuda" and bytes(got.cpu().numpy()) == expected
        values = decode_torch(ref, _u8(expected, "cuda"), meta)
        assert _bits(values) == _bits(ref.decode(expected, meta))


@needs_cuda
@pytest.mark.parametrize("codec", ["float32", "int8", "int4", "fp4"])
@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [2.0, 7.0, 3.0]])
def test_cuda_round_matches_the_cpu_round(codec: str, weights: list[float]) -> None:
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(100_003, generator=gen) for _ in weights]
    cpu, cpu_digests = _round_results(xs, codec, weights, "host")
    cuda, cuda_digests = _round_results([x.cuda() for x in xs], codec, weights, "torch")
    assert cpu_digests == cuda_digests
    for got in cuda:
        assert got.device.type == "cuda" and _bits(got) == _bits(cpu[0])


@needs_cuda
@pytest.mark.parametrize("codec", ["float32", "int4"])
def test_cuda_round_with_large_chunks_matches_the_cpu_round(codec: str) -> None:
    # Chunks of 2 MiB: hashed on every core, through page-locked copies.
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(3 << 19, generator=gen) for _ in range(3)]
    weights = [1.0, 1.0, 1.0]
    cpu, cpu_digests = _round_results(xs, codec, weights, "host", chunk_numel=1 << 19)
    cuda, cuda_digests = _round_results([x.cuda() for x in xs], codec, weights, "torch",
                                        chunk_numel=1 << 19)
    assert len(cpu_digests) == 1 and cpu_digests == cuda_digests
    for got in cuda:
        assert _bits(got) == _bits(cpu[0])
