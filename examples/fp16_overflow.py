"""FP16 attention whose raw scores overflow: eager PyTorch gives NaN, the compiled model stays finite.

E.T. §3.3: ``softmax(q·k / sqrt(d))`` computed as written first forms ``q·k``, which can exceed the
fp16 range (65504) even when the scaled logits are small. ``attncomp.compile`` moves the scale onto
q and, with frozen weights, folds it into the query projection, so no score is ever formed unscaled.

Run on CPU: ``python examples/fp16_overflow.py``.
"""

import math

import torch
import torch.fx as fx
import torch.nn as nn

import attncomp


class SelfAttention(nn.Module):
    def __init__(self, d_model=128, heads=2):
        super().__init__()
        self.h, self.dh = heads, d_model // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x):
        B, N, d = x.shape
        q = self.q(x).view(B, N, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(B, N, self.h, self.dh).transpose(1, 2)
        v = self.v(x).view(B, N, self.h, self.dh).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.dh)
        z = torch.softmax(scores, dim=-1) @ v
        return self.o(z.transpose(1, 2).reshape(B, N, d))


def main():
    torch.manual_seed(0)
    d, n = 128, 16
    model = SelfAttention(d)
    with torch.no_grad():  # large, aligned q and k: |q·k| ~ 1e5 on the diagonal, > fp16 max
        w = torch.randn(d, d) * (40 / math.sqrt(d))
        model.q.weight.copy_(w)
        model.k.weight.copy_(w)
    model = model.eval().requires_grad_(False)
    x = torch.randn(1, n, d)

    ref = model.double()(x.double())                 # float64: the true answer
    model = model.half()
    x16 = x.half()
    with torch.no_grad():
        q = model.q(x16).view(1, n, model.h, model.dh).transpose(1, 2).double()
        raw = (q @ q.transpose(-1, -2)).abs().max().item()
    print(f"largest |q·k| (exact):           {raw:10.0f}   fp16 max is {torch.finfo(torch.float16).max:.0f}")
    print(f"largest |q·k|/sqrt(d) (exact):   {raw / math.sqrt(model.dh):10.0f}   representable in fp16")

    eager = model(x16)
    bad = (~torch.isfinite(eager)).sum().item()
    print(f"eager fp16:    {bad} of {eager.numel()} outputs are inf/NaN (q·k overflowed before the scale)")

    fast = attncomp.compile(model, policy="et", example_inputs=(x16,))
    out = fast(x16)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    print(f"compiled fp16: {(~torch.isfinite(out)).sum().item()} non-finite outputs; "
          f"relative error vs float64 = {err:.1e} (fp16 rounding is ~1e-3)")
    site = attncomp.report(fast).sites[0]
    print(f"what the compiler did: {site.details['scale_reorder']}")

    # The CPU reference backend forms q·k in float32; an fp16 kernel forms it in fp16. The op's own
    # inputs after the rewrite keep even a pure-fp16 q·k in range:
    q, k = op_inputs(fast.graph_module, x16)
    peak = (q @ k.transpose(-1, -2)).abs().max().item()
    print(f"the op's q·k in pure fp16 after the rewrite: max {peak:.0f} (finite: {math.isfinite(peak)})")


def op_inputs(gm, *args):
    """The q and k tensors the attncomp::attention op receives."""
    seen = {}

    class Grab(fx.Interpreter):
        def run_node(self, n):
            if attncomp.ops.is_attention_node(n):
                seen["q"], seen["k"] = self.env[n.args[0]], self.env[n.args[1]]
            return super().run_node(n)

    Grab(gm).run(*args)
    return seen["q"], seen["k"]


if __name__ == "__main__":
    main()
