"""The chunked loss and activation checkpointing change memory, not results: the same loss
and gradients (up to float rounding) as whole logits and kept activations, on the builtin
model and a Hugging Face Llama, through deep copies; and they keep less for the backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dilonode.config import ModelConfig
from dilonode.train.loss import chunked_cross_entropy
from dilonode.train.memory import saved_bytes
from dilonode.train.model import build_model, lm_loss, loss_chunk_of

VOCAB = 9000


def _loss_and_grads(cfg: ModelConfig, vocab: int = VOCAB) -> tuple[float, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(cfg, vocab)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (2, 24), generator=gen)
    y = torch.randint(0, vocab, (2, 24), generator=gen)
    loss = lm_loss(model, x, y)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


def _close(a: list[torch.Tensor], b: list[torch.Tensor], tol: float) -> bool:
    return all(torch.allclose(x, y, atol=tol, rtol=1e-4) for x, y in zip(a, b, strict=True))


def test_chunked_cross_entropy_equals_the_whole_logits_one():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, generator=gen, requires_grad=True)
    w = torch.randn(300, 16, generator=gen, requires_grad=True)
    y = torch.randint(0, 300, (50,), generator=gen)
    whole = F.cross_entropy(F.linear(h, w).float(), y)
    gh, gw = torch.autograd.grad(whole, (h, w))
    for chunk in (1, 7, 50, 64):
        part = chunked_cross_entropy(h, w, y, chunk)
        ch, cw = torch.autograd.grad(part, (h, w))
        assert torch.allclose(part, whole, atol=1e-5)
        assert torch.allclose(ch, gh, atol=1e-6) and torch.allclose(cw, gw, atol=1e-6)
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(h, w, y, 0)


@pytest.mark.parametrize("option", [{"loss_chunk_tokens": 5},
                                    {"activation_checkpointing": True},
                                    {"loss_chunk_tokens": 7, "activation_checkpointing": True}])
def test_the_builtin_model_trains_the_same_with_either(option):
    base_loss, base = _loss_and_grads(ModelConfig(preset="nano", loss_chunk_tokens=0))
    loss, grads = _loss_and_grads(ModelConfig(preset="nano", **{"loss_chunk_tokens": 0,
                                                               **option}))
    assert loss == pytest.approx(base_loss, abs=1e-5)
    assert _close(grads, base, 1e-6)


def test_a_hugging_face_llama_trains_the_same_with_activation_checkpointing():
    pytest.importorskip("transformers")
    base_loss, base = _loss_and_grads(ModelConfig(kind="hf_llama", preset="nano"), 300)
    loss, grads = _loss_and_grads(ModelConfig(kind="hf_llama", preset="nano",
                                              activation_checkpointing=True), 300)
    assert loss == pytest.approx(base_loss, abs=1e-5) and _close(grads, base, 1e-6)


def test_a_deep_copy_of_a_checkpointed_model_runs_its_own_weights():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="nano", activation_checkpointing=True), 256)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randint(0, 256, (1, 8))
    assert not torch.equal(model(x), twin(x))  # the copy's blocks use the copy's weights
    assert all(b.forward.__self__ is b for b in twin.blocks)


def test_both_keep_less_for_the_backward_pass():
    kept = {}
    for name, cfg in {"plain": ModelConfig(preset="tiny", loss_chunk_tokens=0),
                      "checkpointed": ModelConfig(preset="tiny", loss_chunk_tokens=0,
                                                  activation_checkpointing=True),
                      "chunked": ModelConfig(preset="tiny", loss_chunk_tokens=64)}.items():
        torch.manual_seed(0)
        kept[name] = saved_bytes(build_model(cfg, VOCAB), VOCAB, 128, batch=2)
    assert kept["checkpointed"] < 0.5 * kept["plain"]
    # The whole float32 logits [256, 9000] (9.2 MB) and their bf16 copy are not kept.
    assert kept["plain"] - kept["chunked"] > 256 * VOCAB * 4


def test_auto_chunks_large_vocabularies_of_builtin_models_only():
    assert loss_chunk_of(ModelConfig(), 256) == 0
    assert loss_chunk_of(ModelConfig(), 32000) == 1024
    assert loss_chunk_of(ModelConfig(kind="hf_llama"), 32000) == 0
    with pytest.raises(ValueError, match="builtin model only"):
        loss_chunk_of(ModelConfig(kind="hf_llama", loss_chunk_tokens=512), 32000)
