"""model.kind = "hf": a local Hugging Face model directory, named by its content, and the
decoder layers FSDP2 shards one by one (`transformer_blocks`)."""

from __future__ import annotations

import shutil

import pytest
import torch

from dilonode.config import ConfigError, ModelConfig, load_config
from dilonode.train.model import build_model, lm_loss, model_identity, transformer_blocks
from dilonode.train.state import config_digest

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "llama"
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=2,
                                   num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_kind_hf_needs_a_path():
    with pytest.raises(ConfigError, match="kind=hf needs a local"):
        load_config(overrides={"model": {"kind": "hf"}})


def test_loads_the_directory_without_downloading(hf_dir):
    model = build_model(ModelConfig(kind="hf", path=hf_dir), 256)
    x = torch.randint(0, 256, (2, 8))
    assert torch.isfinite(lm_loss(model, x, x))
    blocks = transformer_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["LlamaDecoderLayer"] * 2


def test_a_vocabulary_too_small_is_refused(hf_dir):
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        build_model(ModelConfig(kind="hf", path=hf_dir), 512)


def test_the_run_is_named_by_content_not_path(hf_dir, tmp_path):
    copy = tmp_path / "elsewhere"
    shutil.copytree(hf_dir, copy)
    a = load_config(overrides={"model": {"kind": "hf", "path": str(hf_dir)}})
    b = load_config(overrides={"model": {"kind": "hf", "path": str(copy)}})
    assert model_identity(a.model) == model_identity(b.model) != ""
    assert config_digest(a) == config_digest(b)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    c = load_config(overrides={"model": {"kind": "hf", "path": str(copy)}})
    assert config_digest(c) != config_digest(a)


def test_missing_weights_are_a_user_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        build_model(ModelConfig(kind="hf", path=tmp_path), 256)


def test_builtin_blocks_are_found_by_name():
    model = build_model(ModelConfig(preset="nano"), 256)
    assert len(transformer_blocks(model)) == 3
