"""One node on several local ranks (processes over gloo on CPU, as CI has no GPU).

A 2-rank node (DDP, FSDP2) ends where a 1-rank node with the same global batch ends; a
checkpoint written by 4 ranks resumes on 2; a local Hugging Face model directory trains on
2 ranks. Each test spawns its ranks with a hard timeout (tests/integration/ranks_harness.py).
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.ranks_harness import run_ranks, train_node
from tests.support.config import nano_overrides

pytestmark = pytest.mark.slow

STEPS = 12  # 3 rounds of every fragment (H = 4, P = 3)
CFG = nano_overrides(seed=3, total_steps=STEPS, codec={"name": "float32"},
                     diloco={"sync_every": 4, "pacing": "steps"})
# The ranks average gradients over halves of the batch where one rank takes the mean of
# the whole: float rounding apart, the same run.
TOL = {"atol": 1e-4, "rtol": 0}


@pytest.fixture(scope="module")
def one_rank():
    return train_node(None, CFG, STEPS)


def _check_same(ref, got):
    torch.testing.assert_close(got["outer"], ref["outer"], **TOL)
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-4)
    assert got["eval"] == pytest.approx(ref["eval"], abs=1e-4)
    assert got["state"].keys() == ref["state"].keys()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_equal_one_rank_with_the_same_global_batch(one_rank, strategy):
    got = run_ranks(2, train_node, {**CFG, "dist": {"strategy": strategy}}, STEPS,
                    timeout=200)[0]
    assert got["strategy"] == strategy
    _check_same(one_rank, got)


@pytest.mark.timeout(300)
def test_a_four_rank_checkpoint_resumes_on_two_ranks(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    # Step 7: a step with no round in flight (checkpoints are taken there).
    four = run_ranks(4, train_node, {**CFG, "dist": {"strategy": "fsdp"}}, 7, ckpt,
                     timeout=240)[0]
    two = run_ranks(2, train_node, CFG, 5, None, ckpt, timeout=200)[0]
    one = train_node(None, CFG, 5, None, ckpt)
    # what was saved is what both import, bit for bit; then they train on alike
    torch.testing.assert_close(two["imported"], four["outer"], atol=0, rtol=0)
    torch.testing.assert_close(one["imported"], four["outer"], atol=0, rtol=0)
    _check_same(one, two)


@pytest.mark.timeout(300)
def test_a_local_hf_model_directory_trains_on_two_ranks(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "llama")
    cfg = {**CFG, "model": {"kind": "hf", "path": str(tmp_path / "llama")}}
    ref = train_node(None, cfg, STEPS)
    got = run_ranks(2, train_node, {**cfg, "dist": {"strategy": "fsdp"}}, STEPS,
                    timeout=240)[0]
    assert got["losses"][-1] < got["losses"][0]
    assert any(k.startswith("model.layers.2.") for k in got["state"])
    _check_same(ref, got)
