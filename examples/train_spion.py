"""Train a small encoder with SPION (seed 003) on CPU, against the same model trained dense.

The task has real long-range structure: each position predicts the token at a far position that
depends on the position's half,

    y[i] = x[partner(i)],   partner(i) = i + L/2 in the first half,  L - 1 - i in the second,

so the attention has to learn a shifted band and an anti-diagonal: a pattern no local window covers.
``attncomp.compile(model, policy=SPION(...))`` starts dense and records each layer's pooled attention
map every step (from the op's log-sum-exp, without the ``N x N`` probabilities); every ``--interval``
steps it compares the mean map with the previous one and switches a layer to its flood-fill pattern
once two successive relative distances are below ``--alpha`` (Alg. 2, see ``attncomp.spion``). On
this task the loss sits on a plateau for about 120 steps with near-uniform maps, then the attention
forms; the distance (relative to the map's deviation from uniform) stays high on the plateau and
while the attention forms, and falls below 0.1 once it has formed, so the layers switch around steps
200-270. ``--switch S`` instead calls ``attncomp.spion.calibrate`` on a few batches after ``S``
training steps (the explicit switch).

Prints the switch step and per-layer densities, times per step (dense vs sparse) and writes
``spion_loss.png`` (loss curves) and ``spion_layer<k>.png`` (patterns). ``--smoke`` runs in seconds.

On the reference backend (CPU) a sparse step costs what a dense one does: it materialises the full
``N x N`` logits and masks them. The speed of SPION comes from the block-sparse kernels on a GPU; the
per-layer density is the fraction of attention work they do.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.nn as nn

import attncomp
from attncomp import plot, spion


def make_batch(b: int, L: int, V: int, g: torch.Generator):
    x = torch.randint(0, V, (b, L), generator=g)
    return x, x[:, partner(L)]


def partner(L: int) -> torch.Tensor:
    """Where each position reads its label: half a sequence away in the first half, the mirror image
    in the second."""
    i = torch.arange(L)
    return torch.where(i < L // 2, i + L // 2, L - 1 - i)


def sinusoids(L: int, d: int) -> torch.Tensor:
    i = torch.arange(L, dtype=torch.float32)[:, None]
    f = torch.exp(-math.log(10000.0) * torch.arange(0, d, 2, dtype=torch.float32) / d)
    return torch.cat([torch.sin(i * f), torch.cos(i * f)], 1)


class Layer(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h, self.hd = h, d // h
        self.scale = 1.0 / math.sqrt(d // h)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, N, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        p = ((q @ k.transpose(-1, -2)) * self.scale).softmax(-1)
        x = x + self.o((p @ v).transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.n2(x))


class Encoder(nn.Module):
    def __init__(self, V: int, L: int, d: int, h: int, layers: int):
        super().__init__()
        self.tok = nn.Embedding(V, d)
        self.register_buffer("pos", sinusoids(L, d))
        self.layers = nn.ModuleList([Layer(d, h) for _ in range(layers)])
        self.out = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, V))

    def forward(self, x):
        z = self.tok(x) + self.pos[: x.shape[1]]
        for layer in self.layers:
            z = layer(z)
        return self.out(z)


def train(fast, model, steps, args, on_step=None):
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses, times = [], []
    for step in range(steps):
        x, y = make_batch(args.batch, args.length, args.vocab, g)
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(fast(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, loss.item())
    return losses, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="a few steps on a tiny model (seconds)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--switch", type=int, default=None,
                    help="calibrate and switch after this many steps instead of the automatic switch (Alg. 2)")
    ap.add_argument("--alpha", type=float, default=0.1, help="Alg. 2 transition threshold (relative distance)")
    ap.add_argument("--interval", type=int, default=10, help="Alg. 2 interval (steps)")
    ap.add_argument("--threshold", type=float, default=0.85, help="flood-fill quantile")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--inductor", action="store_true", help="compile around the op with Inductor (slower start)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.length, args.batch, args.layers = 8, 64, 4, 2
        if args.switch is None:
            args.alpha, args.interval = 10.0, 2     # any change is small: switch after three intervals
    torch.manual_seed(args.seed)
    d, h = 64, 4

    results = {}
    for name in ("dense", "spion"):
        torch.manual_seed(args.seed)
        model = Encoder(args.vocab, args.length, d, h, args.layers).train()
        policy = "dense" if name == "dense" else attncomp.SPION(block_size=args.block, filter_size=7,
                                                                threshold=args.threshold,
                                                                alpha=None if args.switch is not None else args.alpha,
                                                                interval=args.interval)
        fast = attncomp.compile(model, policy=policy, backend="reference", inductor=args.inductor)

        def on_step(step, loss, name=name, fast=fast):
            if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
                print(f"[{name}] step {step:4d}  loss {loss:.4f}", flush=True)
            if name == "spion" and args.switch is not None and step + 1 == args.switch:
                g = torch.Generator().manual_seed(args.seed + 2)
                batches = [make_batch(args.batch, args.length, args.vocab, g)[0] for _ in range(4)]
                spion.calibrate(fast, batches)
                print(f"[spion] calibrated after step {step}:\n{spion.summary(fast)}", flush=True)

        losses, times = train(fast, model, args.steps, args, on_step)
        results[name] = dict(losses=losses, times=times, fast=fast)

    sp = results["spion"]
    print("\nSPION sites:")
    print(spion.summary(sp["fast"]))
    # a site's switch step counts its training calls from 1; the call that switches still runs dense,
    # so on the 0-based step axis the site runs sparse from its switch step on
    sites = sorted(spion.state_of(sp["fast"]).sites.values(), key=lambda s: s.index)
    if args.switch is not None:
        switch = args.switch if any(s.pattern is not None for s in sites) else None
    else:
        sw = [s.switch_step for s in sites if s.switch_step is not None]
        switch = max(sw) if sw else None
        for s in sites:
            ds = ", ".join(f"{d:.3f}" for d in s.distances)
            print(f"  {s.name}: interval distances d_i = {ds}")
    warm = 3   # the first steps include capture and compilation
    td = results["dense"]["times"][warm:]
    if switch is not None:
        tsp, tdn = sp["times"][max(switch + 1, warm):], sp["times"][warm:switch]
    else:
        tsp, tdn = [], sp["times"][warm:]
    med = (lambda t: sorted(t)[len(t) // 2] * 1e3 if t else float("nan"))
    print(f"\nsparse from step {switch if switch is not None else '- (no layer switched)'} (0-based)")
    for s in sites:
        dens = "-" if s.pattern is None else f"{s.density:.3f}"
        print(f"  {s.name}: density {dens}, switched after {s.switch_step} training step(s)")
    print(f"time per step (median, CPU reference backend): dense model {med(td):.1f} ms; "
          f"SPION model dense phase {med(tdn):.1f} ms, sparse phase {med(tsp):.1f} ms")
    print(f"final loss (mean of last 10 steps): dense {sum(results['dense']['losses'][-10:]) / 10:.4f}, "
          f"spion {sum(sp['losses'][-10:]) / 10:.4f}")

    os.makedirs(args.out, exist_ok=True)
    marks = {"switch": switch} if switch is not None else None
    path = plot.curves(os.path.join(args.out, "spion_loss.png"),
                       {"dense": results["dense"]["losses"], "spion": sp["losses"]},
                       title=f"training loss, L={args.length}, block {args.block}", ylabel="loss", marks=marks)
    print(f"wrote {path}")
    for i, (site, p) in enumerate(spion.patterns(sp["fast"]).items()):
        if p is not None:
            print(f"wrote {plot.pattern(sp['fast'], site, os.path.join(args.out, f'spion_layer{i}.png'))}")


if __name__ == "__main__":
    main()
