"""The codec table is the one list of codecs: every row has an implementation whose sizes
match its properties, and the config, the CLI and the splicer read the same names."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from dilonode.algo.codec_table import (
    BLOCK_CODEC_NAMES,
    CODEC_NAMES,
    CODECS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CODEC,
    FLOAT_CODEC_NAMES,
    unknown_codec_message,
)
from dilonode.algo.codecs import CodecError, get_codec
from dilonode.algo.sliced_encoding import splice_supported
from dilonode.cli.main import build_parser
from dilonode.config import CodecConfig, ConfigError, load_config, parse_overrides


def test_the_table_imports_nothing_heavy():
    code = ("import sys\nimport dilonode.algo.codec_table\n"
            "heavy = {'torch', 'numpy', 'numba'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_rows_are_float_or_block_and_partition_the_names():
    assert set(FLOAT_CODEC_NAMES) | set(BLOCK_CODEC_NAMES) == set(CODEC_NAMES)
    assert not set(FLOAT_CODEC_NAMES) & set(BLOCK_CODEC_NAMES)
    for name, spec in CODECS.items():
        assert spec.name == name and spec.summary
        assert (spec.float_dtype is None) == spec.is_block == (spec.quantizer is not None)
        assert spec.default_block_size == (DEFAULT_BLOCK_SIZE if spec.is_block else 1)
    assert DEFAULT_CODEC in CODECS


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_each_row_has_a_codec_of_its_sizes(name):
    spec = CODECS[name]
    codec = get_codec(name)
    assert codec.name == name and codec.block_size == spec.default_block_size
    for n in (0, 1, 63, 64, 65, 1001):
        scales = 4 * math.ceil(n / codec.block_size) if spec.is_block else 0
        assert codec.encoded_size(n) == scales + spec.payload_bytes(n)
        assert len(codec.encode(torch.zeros(n))[0]) == codec.encoded_size(n)
    if spec.float_dtype is not None:
        assert torch.finfo(getattr(torch, spec.float_dtype)).bits == spec.bits


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_config_and_splicer_accept_each_row(name):
    assert load_config(overrides={"codec": {"name": name}}).codec.name == name
    assert splice_supported(name)


def test_unknown_names_are_refused_in_one_line_naming_the_table():
    with pytest.raises(CodecError, match=f"^{unknown_codec_message('int3')}$"):
        get_codec("int3")
    with pytest.raises(ConfigError) as info:
        load_config(overrides=parse_overrides(["codec.name=int3"]))
    assert "\n" not in str(info.value) and ", ".join(CODEC_NAMES) in str(info.value)
    assert not splice_supported("int3")
    assert CodecConfig.model_json_schema()["properties"]["name"]["enum"] == list(CODEC_NAMES)


def test_cli_help_lists_every_codec(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["simulate", "--help"])
    assert " ".join(capsys.readouterr().out.split()).count(", ".join(CODEC_NAMES)) == 1
