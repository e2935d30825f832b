"""Unit tests for dilonode.train.model and dilonode.train.device (CPU only, nano preset).

Also hosts the tiny factories that the kind=factory tests name as
``tests.unit.test_model:make_mlp`` and friends.
"""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from torch import nn

from dilonode.config import ModelConfig
from dilonode.train.device import autocast, pick_device
from dilonode.train.model import (
    PRESETS,
    Transformer,
    build_model,
    lm_loss,
    param_count,
    resolve_model_dims,
)

V = 256
NANO = ModelConfig(preset="nano")


def make_mlp(vocab_size: int) -> nn.Module:
    """Factory used via 'tests.unit.test_model:make_mlp'."""
    return nn.Sequential(nn.Embedding(vocab_size, 16), nn.Linear(16, vocab_size))


def make_fixed() -> nn.Module:
    """Factory without a vocab_size parameter: called with no arguments."""
    return nn.Sequential(nn.Embedding(300, 8), nn.Linear(8, 300))


def make_not_a_module() -> int:
    return 42


def _nano(seed: int = 0, **overrides: object) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="nano", **overrides), V)


def test_forward_shape_and_dtype() -> None:
    model = _nano()
    idx = torch.randint(0, V, (3, 17))
    logits = model(idx)
    assert logits.shape == (3, 17, V)
    assert logits.dtype == torch.float32


def test_causal_future_tokens_do_not_change_past_logits() -> None:
    model = _nano().eval()
    idx = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(1))
    changed = idx.clone()
    changed[:, 12:] = (changed[:, 12:] + 7) % V
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :12], b[:, :12])
    assert not torch.allclose(a[:, 12:], b[:, 12:])


def test_param_names_tied_and_untied() -> None:
    tied = [n for n, _ in _nano(tie_embeddings=True).named_parameters()]
    untied = [n for n, _ in _nano(tie_embeddings=False).named_parameters()]
    assert tied[0] == "tok_emb.weight" and tied[-1] == "norm.weight"
    assert "lm_head.weight" not in tied
    assert untied[-1] == "lm_head.weight" and untied[-2] == "norm.weight"
    middle = tied[1:-1]
    assert all(n.startswith("blocks.") for n in middle)
    assert {int(n.split(".")[1]) for n in middle} == {0, 1, 2}
    d = PRESETS["nano"]["d_model"]
    assert param_count(_nano(tie_embeddings=False)) - param_count(_nano()) == V * d


def test_rope_tables_stay_out_of_state_dict() -> None:
    assert not any("rope" in k for k in _nano().state_dict())


def test_preset_overrides() -> None:
    dims = resolve_model_dims(ModelConfig(preset="nano", d_model=64, n_layers=2, n_heads=4))
    assert dims == {"d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 64,
                    "max_seq_len": 256}
    model = build_model(ModelConfig(preset="nano", n_layers=1, max_seq_len=16), V)
    assert isinstance(model, Transformer)
    assert len(model.blocks) == 1 and model.max_seq_len == 16
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_override_breaking_head_split_names_fields() -> None:
    # 36 / nano's 2 heads = 18 is fine; 34 / 2 = 17 is odd and cannot be rotated.
    resolve_model_dims(ModelConfig(preset="nano", d_model=36))
    with pytest.raises(ValueError, match="model.d_model = 34"):
        resolve_model_dims(ModelConfig(preset="nano", d_model=34))
    with pytest.raises(ValueError, match="model.n_heads = 2"):
        resolve_model_dims(ModelConfig(preset="nano", d_model=33))


def test_config_vocab_size_pads_but_never_shrinks() -> None:
    model = build_model(ModelConfig(preset="nano", vocab_size=320), V)
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape[-1] == 320
    with pytest.raises(ValueError, match="model.vocab_size = 100"):
        build_model(ModelConfig(preset="nano", vocab_size=100), V)


def test_init_is_deterministic_under_seed() -> None:
    a, b, c = _nano(0).state_dict(), _nano(0).state_dict(), _nano(1).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])
    std = a["blocks.0.mlp.gate.weight"].std().item()
    resid = a["blocks.0.mlp.down.weight"].std().item()
    assert 0.015 < std < 0.025
    assert resid < std / 2  # scaled by 1/sqrt(2 * 3 layers)


def test_loss_decreases_with_adamw() -> None:
    model = _nano()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, V, (4, 32), generator=gen)
    y = torch.roll(x, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = lm_loss(model, x, y)
    assert abs(first.item() - torch.log(torch.tensor(float(V))).item()) < 0.5
    for _ in range(30):
        opt.zero_grad()
        loss = lm_loss(model, x, y)
        loss.backward()
        opt.step()
    assert loss.dim() == 0
    assert loss.item() < first.item() - 1.0


def test_lm_loss_accepts_objects_with_logits() -> None:
    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = _nano()

        def forward(self, idx: torch.Tensor) -> object:
            return type("Out", (), {"logits": self.inner(idx)})()

    wrapped = Wrapped()
    x = torch.randint(0, V, (2, 8))
    y = torch.randint(0, V, (2, 8))
    torch.testing.assert_close(lm_loss(wrapped, x, y), lm_loss(wrapped.inner, x, y))


def test_factory_kind() -> None:
    model = build_model(ModelConfig(kind="factory", factory="tests.unit.test_model:make_mlp"), 77)
    assert model[1].out_features == 77
    x = torch.randint(0, 77, (2, 5))
    assert lm_loss(model, x, x).dim() == 0
    fixed = build_model(ModelConfig(kind="factory", factory="tests.unit.test_model:make_fixed"), V)
    assert fixed[0].num_embeddings == 300


@pytest.mark.parametrize("spec, needle", [
    ("tests.unit.test_model:make_not_a_module", "returned int"),
    ("tests.unit.test_model:nope", "no callable 'nope'"),
    ("no_such_pkg_xyz.mod:make", "cannot import"),
])
def test_factory_errors_name_the_factory(spec: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle) as err:
        build_model(ModelConfig(kind="factory", factory=spec), V)
    assert spec in str(err.value) and "\n" not in str(err.value)


def test_hf_llama_kind() -> None:
    cfg = ModelConfig(kind="hf_llama", preset="nano")
    if importlib.util.find_spec("transformers") is None:
        with pytest.raises(ValueError) as err:
            build_model(cfg, V)
        assert str(err.value) == ("model.kind=hf_llama needs the 'hf' extra: "
                                  "pip install 'dilonode[hf]'")
        return
    model = build_model(cfg, V)
    x = torch.randint(0, V, (2, 8))
    assert lm_loss(model, x, x).dim() == 0


def test_param_count_150m_on_meta_device() -> None:
    with torch.device("meta"):
        model = build_model(ModelConfig(preset="150m"), 32000)
    assert 140_000_000 < param_count(model) < 160_000_000  # ~150M with a 32k vocab


def test_pick_device_and_autocast() -> None:
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type in ("cpu", "cuda")
    assert isinstance(autocast(torch.device("cpu")), contextlib.nullcontext)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device = 'cuda'"):
            pick_device("cuda")
    with pytest.raises(ValueError, match="device = 'tpu'"):
        pick_device("tpu")  # type: ignore[arg-type]
