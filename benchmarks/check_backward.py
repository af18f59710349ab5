"""Compare the Triton backward with the reference on BERT-like inputs (a diagnostic; GPU)."""
import torch, attncomp
torch.manual_seed(0)
B, H, N, D = 2, 4, 200, 64
def rel(a, b): return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()
for name in ["none", "float_b11n_min", "float_b11n_zero", "bool_b11n", "float_bhnn"]:
    for dt in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
        m = None
        if name == "float_b11n_min":
            m = torch.zeros(B, 1, 1, N, device="cuda", dtype=dt); m[1, ..., 150:] = torch.finfo(dt).min
        if name == "float_b11n_zero":
            m = torch.zeros(B, 1, 1, N, device="cuda", dtype=dt)
        if name == "bool_b11n":
            m = torch.ones(B, 1, 1, N, device="cuda", dtype=torch.bool); m[1, ..., 150:] = False
        if name == "float_bhnn":
            m = torch.randn(B, H, N, N, device="cuda", dtype=dt)
        res = []
        go = torch.randn(B, H, N, D, device="cuda", dtype=dt)
        for be in ("triton", "reference"):
            o = attncomp.functional.attention(q, k, v, attn_mask=m, scale=1.0, policy="dense", backend=be)
            res.append((o, torch.autograd.grad(o, (q, k, v), go)))
        print(name, dt, "out", f"{rel(res[0][0], res[1][0]):.2e}", "grads", [f"{rel(a, b):.2e}" for a, b in zip(res[0][1], res[1][1])])
