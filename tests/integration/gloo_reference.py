"""DiLoCo written the straightforward way (the loop from the OpenDiLoCo article), run with
torch.distributed gloo on loopback, one process per worker. The simulator must match it.
"""

from __future__ import annotations

import datetime
import faulthandler

import torch
import torch.distributed as dist

from dilonode.cli.fast_exit import exit_without_finalizing
from dilonode.config import RunConfig
from dilonode.train.data import load_data
from dilonode.train.model import build_model, lm_loss
from dilonode.train.worker import build_inner_optimizer


def run(rank: int, world: int, port: int, cfg_json: str, out_path: str) -> None:
    faulthandler.enable(all_threads=True)  # a crash names where it happened
    cfg = RunConfig.model_validate_json(cfg_json)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    data = load_data(cfg.data)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, data.vocab_size)
    params = [p for p in model.parameters() if p.requires_grad]
    inner = build_inner_optimizer(model, cfg.inner)
    d = cfg.diloco
    outer = torch.optim.SGD(params, lr=d.outer_lr, momentum=d.outer_momentum, nesterov=True)
    batches = data.train_batches(rank, cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed)
    original = [p.detach().clone() for p in params]
    for step in range(1, cfg.total_steps + 1):
        model.zero_grad(set_to_none=True)
        x, y = next(batches)
        lm_loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.inner.grad_clip)
        inner.step()
        if step % d.sync_every == 0:
            for old, p in zip(original, params, strict=True):
                p.grad = old - p.data
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
                p.grad /= world
                p.data = old
            outer.step()
            original = [p.detach().clone() for p in params]
    if rank == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out_path)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalizing(0)  # gloo can abort at interpreter exit (see there)
