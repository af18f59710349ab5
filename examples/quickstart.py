"""attncomp in one page: compile a small transformer with a sparse policy, read the report, run it,
compare it with eager PyTorch and with the dense compile, then export it and load it back.

Then ``generate()`` with a compiled Hugging Face causal LM (default config, KV cache on): the compiled
sites run at every decoding step and the tokens equal eager's.

Run with ``make demo`` (or ``python examples/quickstart.py``). ``backend="auto"`` runs the fastest
correct kernel for the device (Triton or SDPA on a GPU; SDPA's CPU kernel, TVM or the reference on CPU);
Inductor compiles everything around the attention op.
"""

import math
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attncomp


class Block(nn.Module):
    """A GPT-style block written the way many research codebases write it."""

    def __init__(self, d: int, heads: int, n_max: int):
        super().__init__()
        self.h = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.register_buffer("bias", torch.tril(torch.ones(n_max, n_max)).view(1, 1, n_max, n_max))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, d=128, heads=4, layers=2, n_max=256):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(n_max, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, n_max) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = TinyGPT().to(device=device, dtype=dtype).eval()
    ids = torch.randint(0, 256, (2, 128), device=device)
    print(f"device: {device}, dtype: {dtype}\n")

    t0 = time.perf_counter()
    fast = attncomp.compile(model, policy="dfss", example_inputs=(ids,))
    print(f"compiled with policy='dfss' in {time.perf_counter() - t0:.1f} s\n")
    print(attncomp.report(fast))
    print()

    dense = attncomp.compile(model, policy="dense", example_inputs=(ids,))
    with torch.no_grad():
        ref = model(ids)
        out_dense = dense(ids)
        out_dfss = fast(ids)
        ids2 = torch.randint(0, 256, (3, 97), device=device)
        out_new_len = fast(ids2)
    print("what the numbers mean:")
    print(f"  dense compile vs eager, relative error  {rel(out_dense, ref):.2e}"
          "   (same computation: only rounding differs)")
    print(f"  dfss compile vs eager, relative error   {rel(out_dfss, ref):.2e}"
          "   (2:4 / 1:2 pruning of the attention logits changes the result by design)")
    agree = (out_dfss.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"  dfss vs eager, top-1 token agreement    {agree:.1%}")
    print(f"  new shape {tuple(ids2.shape)} ran without re-tracing: output {tuple(out_new_len.shape)}\n")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tinygpt-dfss.acpkg")
        attncomp.export(fast, path, example_inputs=(ids,))
        again = attncomp.load(path)
        with torch.no_grad():
            out_loaded = again(ids)
        print(f"exported to {os.path.basename(path)} ({os.path.getsize(path) / 1e6:.1f} MB), loaded without tracing:")
        print(f"  loaded vs compiled, max abs difference  {(out_loaded.float() - out_dfss.float()).abs().max().item():.2e}")
    generate_demo(device)


def generate_demo(device):
    try:
        import transformers as T
    except ImportError:
        print("\n(transformers is not installed: skipping the generate() demo)")
        return
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, vocab_size=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm = T.LlamaForCausalLM(cfg).to(device).eval()
    fast = attncomp.compile(lm, policy="dense")
    prompt = torch.randint(3, 512, (2, 12), device=device)
    mask = torch.ones_like(prompt)
    mask[1, :4] = 0  # left padding, as batched generation pads
    with torch.no_grad():
        t0 = time.perf_counter()
        got = fast.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
        t1 = time.perf_counter()
        want = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=8, do_sample=False)
    rep = attncomp.report(fast)
    print(f"\ngenerate() on a compiled LlamaForCausalLM (default config, KV cache), first call {t1 - t0:.1f} s "
          f"including compilation:")
    print(f"  {rep.rewritten} of {len(rep.sites)} attention sites compiled, {rep.graphs} graph(s) for prefill and decoding")
    for s in rep.sites:
        print(f"  {s.name}: {s.details.get('mask', s.spec)}")
    print(f"  tokens equal eager's: {torch.equal(got, want)}")
    print(f"  new tokens: {got[:, prompt.shape[1]:].tolist()}")


if __name__ == "__main__":
    main()
