"""The plain torch process that bench/step_costs.py sets ddptrain's resident memory
against: a hand-written DDP loop of a GPT of the built-in one's shape (2 blocks, width
256, 4 heads, 64-token windows) from `torch.nn` alone, AdamW, a global batch of 16.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \
        bench/contestants/plain_gpt.py --out DIR

It imports nothing from ddptrain or the bench, so what it holds is torch's alone; each
rank writes `DIR/rank<R>.json` with its `VmRSS` at the end of its first step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, BLOCK, VOCAB, GLOBAL_BATCH = 256, 64, 64, 16


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        return self.head(self.norm(self.blocks(h, mask=self.mask, is_causal=True)))


def rss_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    g = torch.Generator().manual_seed(rank)
    first = 0.0
    for step in range(3):
        data = torch.randint(0, VOCAB, (GLOBAL_BATCH // world, BLOCK + 1), generator=g)
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step == 0:
            first = rss_mb()
    (out / f"rank{rank}.json").write_text(json.dumps({"rss_mb": first}))
    del model, opt
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
