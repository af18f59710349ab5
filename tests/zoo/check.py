"""The check of one family: build, run eager, count its attention calls, compile with
``policy="dense"``, compare outputs (and ``generate()`` for causal LMs, gradients where asked) with eager.

With ``decode`` (causal LMs, after the dense checks pass): ``static`` generates with the dense compiled model into a
transformers ``StaticCache`` that a forward already initialised (as a second static-cache ``generate()`` or a user's
own cache finds it), the left-padded batch and one row called without ``attention_mask``, each step's logits against
eager's generate into the same kind of cache (``wrong-generate`` if not); for each sparse policy named, the left-padded
``generate()`` of the model compiled with it, each step's logits against the same compiled model's full forward
over the sequence so far (a decoding step computes the last rows of the full forward: ``wrong-decode`` if not);
not checked where the eager model's own steps differ from its full forward (the reason says so).

``check(registry, model_type)`` returns a result dict whose ``status`` is ``pass`` or the first failure
class met (:data:`STATUSES`); ``python -m tests.zoo.check REGISTRY MODEL_TYPE OUT.json [--train]`` runs it
in a process of its own and writes the dict; ``--serve`` runs one family after another for the runner's
worker processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from typing import Any, Dict, Optional, Tuple

os.environ.setdefault("ATTNCOMP_INDUCTOR", "0")  # Inductor's compile dominates on a CPU; --inductor turns it on
if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from tests.utils import rel_err, steps_vs_full_forward, tensors  # noqa: E402
from tests.zoo import families as Z  # noqa: E402
from tests.zoo.count import AttentionCounter  # noqa: E402

TOL = 1e-4
#: (batch, length, padding side) of the two forward comparisons
SHAPES = ((2, 12, "right"), (3, 17, "left"))

#: ``dynamo-differs``: the compiled output is not eager's, but it is ``torch.compile(model, backend="eager")``'s:
#: the model computes otherwise when dynamo traces it (UMT5's eager decoder under transformers 5.17 builds no
#: causal mask, the traced one does), not a rewrite of attncomp
#: ``decode-refused``: generating under a sparse policy raised the clear error of a KV cache whose window layers
#: cannot be given every key (``attncomp.api._full_window_layers``)
STATUSES = ("pass", "eager-fails", "no-attention", "compile-error", "wrong-output", "dynamo-differs",
            "sites-missing", "not-rewritten", "generate-error", "wrong-generate", "wrong-decode", "decode-refused",
            "wrong-grad", "crash", "timeout")
#: ``--decode`` policies by name: the drop rates of ``tests/e2e/test_decode_policies.py``
DECODE_POLICIES = ("dfss", "hash", "drop", "spion")
#: what ``--decode`` takes: the policies, and ``static`` (dense decoding into an initialised static cache)
DECODE_CHECKS = ("static",) + DECODE_POLICIES


def first_line(e: BaseException, limit: int = 300) -> str:
    msg = str(e).strip()
    line = next((ln.strip() for ln in msg.splitlines() if ln.strip()), "")
    return f"{type(e).__name__}: {line}"[:limit]


def _valid_view(t: torch.Tensor, valid: Optional[torch.Tensor]) -> torch.Tensor:
    """The entries of ``t`` at the valid (attending) positions: ``t``'s batch dim is dim 0 and its first
    dim of the sequence's length is the position dim (token outputs, cache keys and values)."""
    if valid is None or t.dim() < 2 or t.shape[0] != valid.shape[0]:
        return t
    n = valid.shape[1]
    for d in range(1, t.dim()):
        if t.shape[d] == n:
            m = valid.view(valid.shape[0], *([1] * (d - 1)), n, *([1] * (t.dim() - d - 1)))
            return t.masked_select(m.expand_as(t)) if t.dtype != torch.bool else t
    return t


def compare(got, want, valid) -> Dict[str, Any]:
    """``{"err": largest relative error over the output tensors, "problem": str or None}``."""
    g, w = tensors(got), tensors(want)
    if len(g) != len(w) or not w:
        return dict(err=None, problem=f"{len(g)} output tensors, eager gives {len(w)}")
    worst = 0.0
    for i, (a, b) in enumerate(zip(g, w)):
        if a.shape != b.shape:
            return dict(err=None, problem=f"output {i} has shape {tuple(a.shape)}, eager {tuple(b.shape)}")
        if not b.is_floating_point():
            if not torch.equal(a, b):
                return dict(err=None, problem=f"output {i} ({b.dtype}) differs from eager")
            continue
        a, b = _valid_view(a, valid), _valid_view(b, valid)
        finite = torch.isfinite(b)
        if not torch.equal(torch.isfinite(a), finite):
            return dict(err=None, problem=f"output {i}: NaN/inf where eager has none (or the reverse)")
        if finite.any():
            worst = max(worst, rel_err(a[finite], b[finite]))
    return dict(err=worst, problem=None)


@contextlib.contextmanager
def count_op_calls():
    """The number of attncomp::attention calls in the block (``calls[0]``)."""
    from attncomp import ops

    calls = [0]
    real = ops._attention_impl

    def counted(*args):
        calls[0] += 1
        return real(*args)

    saved = ops._attention_impl, ops._direct_impl
    ops._attention_impl, ops._direct_impl = counted, torch._disable_dynamo(counted)
    try:
        yield calls
    finally:
        ops._attention_impl, ops._direct_impl = saved


def _no_dropout(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "dropout_rate", "dropout_p"):  # rates read at call time
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return model


def _generate_inputs(cfg):
    """Two rows of 10 tokens, row 1 left-padded with 5 pad tokens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(Z.TOKEN_LOW, Z.TOKEN_HIGH, (2, 10), generator=g)
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, :5] = 0
    pad = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0
    ids[1, :5] = pad
    return dict(input_ids=ids, attention_mask=am)


#: the greedy ``generate()`` of every generate check: 5 new tokens, per-step logits
NEW_TOKENS = 5
_GEN = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
            return_dict_in_generate=True)


def _generate(model, cfg):
    x = _generate_inputs(cfg)
    return model.generate(**x, **_GEN, pad_token_id=x["input_ids"][1, 0].item())


def _steps_err(got, want) -> float:
    """The worst relative difference of two generates' per-step logits, over steps and batch rows."""
    return max(rel_err(a[r], b[r]) for a, b in zip(got.logits, want.logits) for r in range(a.shape[0]))


def _initialised_cache(init, cfg, ids):
    """A transformers ``StaticCache`` long enough for ``ids`` and the new tokens, that a forward of ``init`` (the
    eager model) filled and ``reset()`` emptied: its layers are initialised and their position counter is a tensor
    the model reads into its mask (a fresh cache's is a constant 0)."""
    from transformers import StaticCache

    cache = StaticCache(config=cfg, max_cache_len=ids.shape[1] + NEW_TOKENS)
    init(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)
    cache.reset()
    return cache


def _static_generate(model, init, cfg, x, pad: int):
    """Greedy ``generate()`` of ``model`` from ``x`` into :func:`_initialised_cache`."""
    return model.generate(**x, past_key_values=_initialised_cache(init, cfg, x["input_ids"]), **_GEN, pad_token_id=pad)


def _static_traced(model, cfg, x) -> Optional[str]:
    """Why dynamo's own trace (``torch.compile(model, backend="eager")``, no attncomp) of the prefill into an
    initialised static cache is not eager's (it raises, or its logits differ), or ``None`` where it is."""
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            kw = dict(x, use_cache=True)
            want = model(**kw, past_key_values=_initialised_cache(model, cfg, x["input_ids"])).logits
            got = torch.compile(model, backend="eager")(
                **kw, past_key_values=_initialised_cache(model, cfg, x["input_ids"])).logits
    except Exception as e:  # noqa: BLE001
        return "torch.compile(model, backend='eager') itself fails on the prefill: " + first_line(e)
    finally:
        torch._dynamo.reset()
    err = rel_err(got, want)
    return None if err < TOL else \
        f"torch.compile(model, backend='eager') itself differs from eager on the prefill by {err:.2g}"


def _static_check(model, fast, cfg) -> Tuple[Optional[str], str]:
    """``(failure status or None, what it found)`` of the ``static`` decode check (module docstring)."""
    x = _generate_inputs(cfg)
    pad = int(x["input_ids"][1, 0])  # row 1's left padding (row 0 has none: its call gets no attention_mask)
    worst = 0.0
    for what, xi in (("left-padded batch", x), ("one row without attention_mask", dict(input_ids=x["input_ids"][:1]))):
        try:
            with torch.no_grad():
                want = _static_generate(model, model, cfg, xi, pad)
        except Exception as e:  # noqa: BLE001 (the family's own static cache: nothing of attncomp's to judge)
            return None, "not checked: eager generate into a static cache fails: " + first_line(e)
        with torch.no_grad():  # eager's own static-cache steps against its dynamic-cache ones
            base = _steps_err(want, model.generate(**xi, **_GEN, pad_token_id=pad))
        if base >= TOL:
            return None, (f"not checked: eager's generate into a static cache differs from its generate with a dynamic "
                          f"cache by {base:.2g} ({what})")
        try:
            with torch.no_grad():
                got = _static_generate(fast, model, cfg, xi, pad)
        except Exception as e:  # noqa: BLE001
            traced = _static_traced(model, cfg, xi)
            return ("dynamo-differs", f"static cache, {what}: {traced}") if traced else \
                ("generate-error", f"static cache, {what}: " + first_line(e))
        err = _steps_err(got, want)
        if err >= TOL or not torch.equal(got.sequences, want.sequences):
            traced = _static_traced(model, cfg, xi)
            if traced:
                return "dynamo-differs", f"static cache, {what}: {traced}"
            return "wrong-generate", f"static cache, {what}: step logits differ from eager's by {err:.2g}" + (
                "" if torch.equal(got.sequences, want.sequences) else " (greedy tokens differ)")
        worst = max(worst, err)
    return None, f"static cache: steps within {worst:.1g} of eager's"


def _traced_agrees(model, inputs, gots, wants) -> Optional[str]:
    """Where attncomp's outputs differ from eager's: the reason, if they equal those of
    ``torch.compile(model, backend="eager")`` (dynamo's trace, no attncomp) and those differ from eager's."""
    try:
        torch._dynamo.reset()
        traced = torch.compile(model, backend="eager")
        with torch.no_grad():
            outs = [traced(**x) for x, _ in inputs]
    except Exception:  # noqa: BLE001 (no verdict: the output stays wrong)
        return None
    ours = [compare(g, o, valid)["err"] for g, o, (_, valid) in zip(gots, outs, inputs)]
    theirs = [compare(o, w, valid)["err"] for o, w, (_, valid) in zip(outs, wants, inputs)]
    if max(ours) >= TOL or max(theirs) < TOL:
        return None
    return (f"torch.compile(model, backend='eager') differs from eager by {max(theirs):.2g}, attncomp from it by "
            f"{max(ours):.1g}: the model computes otherwise when dynamo traces it")


def _decode_policy(name: str):
    import attncomp

    return attncomp.Drop(q_rate=0.3, k_rate=0.3, seed=5) if name == "drop" else name


def _cached_bucket_sites(fast) -> str:
    """``"k/n"``: of the attention sites in the compiled module's graphs of one query (its decoding steps), how many
    take the buckets a KV cache keeps as their keys' (``k_aux`` given, :mod:`attncomp.kvcache`)."""
    from attncomp import ops

    A = ops.ARG_INDEX
    steps = [n for gm in fast.graphs for n in gm.graph.nodes if ops.is_attention_node(n)
             and isinstance(n.args[0], torch.fx.Node) and n.args[0].meta.get("val") is not None
             and n.args[0].meta["val"].shape[2] == 1]
    return f"{sum(n.args[A['k_aux']] is not None for n in steps)}/{len(steps)}"


def _decode_error(model, cfg, gen) -> float:
    """:func:`tests.utils.steps_vs_full_forward` of ``gen``, a ``generate()`` of ``model`` from the check's
    left-padded prompt (:func:`_generate`)."""
    x = _generate_inputs(cfg)
    return steps_vs_full_forward(model, gen, x["input_ids"], x["attention_mask"])


def check(registry: str, model_type: str, class_name: Optional[str] = None, train: bool = False,
          generate: Optional[bool] = None, decode: tuple = ()) -> Dict[str, Any]:
    """Run the family's checks; see the module docstring. ``generate`` defaults to causal LMs."""
    import attncomp

    t0 = time.time()
    if class_name is None:
        class_name = Z.registry(registry)[model_type]
        class_name = class_name if isinstance(class_name, str) else class_name[0]  # several: the first
    res: Dict[str, Any] = dict(registry=registry, model_type=model_type, cls=class_name, status=None,
                               eager_calls=None, sites=None, rewritten=None, op_calls=None, reason="",
                               details={})
    det = res["details"]

    def done(status, reason=""):
        res["status"], res["reason"] = status, reason
        res["seconds"] = round(time.time() - t0, 1)
        return res

    # 1. build and eager
    try:
        model, cfg = Z.build(registry, model_type, class_name)
    except Exception as e:  # noqa: BLE001 (every failure is a result)
        return done("eager-fails", "build: " + first_line(e))
    det["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    det["parameters"] = sum(p.numel() for p in model.parameters())
    inputs, wants = [], []
    try:
        for i, (b, n, side) in enumerate(SHAPES):
            if registry == "image":
                # an image classifier pools over every position (ImageGPT's mean), so its output mixes in the
                # rows that attend to nothing (left padding under a causal mask), whose values are the softmax
                # of fill constants in eager and are left out of every comparison here: right padding only
                side = "right"
            x, valid = Z.make_inputs(registry, model, cfg, b, n, side, seed=i)
            with torch.no_grad():
                if i == 0:
                    with AttentionCounter() as counter:
                        want = model(**x)
                else:
                    want = model(**x)
            inputs.append((x, valid))
            wants.append(want)
    except Exception as e:  # noqa: BLE001
        return done("eager-fails", first_line(e))
    res["eager_calls"] = counter.calls
    det["eager_kinds"] = dict(sdpa=counter.sdpa, softmax=counter.softmax, flex=counter.flex)
    if counter.calls == 0:
        return done("no-attention", "no SDPA call and no last-dim softmax feeding a matmul in an eager forward")

    # 2. compile and compare
    try:
        fast = attncomp.compile(model, policy="dense")
        errs, gots = [], []
        for i, ((x, valid), want) in enumerate(zip(inputs, wants)):
            with torch.no_grad():
                if i == 0:
                    with count_op_calls() as calls:
                        got = fast(**x)
                else:
                    got = fast(**x)
            errs.append(compare(got, want, valid))
            gots.append(got)
        rep = attncomp.report(fast)
    except Exception as e:  # noqa: BLE001
        return done("compile-error", first_line(e))
    res["op_calls"] = calls[0]
    res["sites"] = len(rep.sites)
    res["rewritten"] = rep.rewritten
    bad = [f"{s.name}: {s.reason}" for s in rep.sites if not s.rewritten]
    det["not_rewritten"] = bad
    det["notes"] = [n[:300] for n in rep.notes]
    det["graphs"] = rep.graphs
    det["errors"] = [e["err"] for e in errs]
    shape_txt = [f"({b}, {n}, {side}-padded)" if registry != "image" else f"batch {b}" for b, n, side in SHAPES]
    problems = [f"{s}: {e['problem']}" for s, e in zip(shape_txt, errs) if e["problem"]]
    if problems:
        return done("wrong-output", "; ".join(problems))
    if any(e["err"] >= TOL for e in errs):
        traced = _traced_agrees(model, inputs, gots, wants)
        if traced is not None:
            return done("dynamo-differs", traced)
        return done("wrong-output", "relative error " + ", ".join(f"{e['err']:.2g} at {s}"
                                                                  for s, e in zip(shape_txt, errs)))
    counts = f"eager {counter.calls} attention calls, {len(rep.sites)} sites ({rep.rewritten} rewritten), " \
             f"{calls[0]} op calls per forward"
    if bad:
        reasons = sorted({b.split(": ", 1)[1] for b in bad})
        return done("not-rewritten", f"{len(bad)} of {len(rep.sites)} sites not rewritten: "
                                     + " | ".join(r[:200] for r in reasons) + f" ({counts})")
    if calls[0] < counter.calls:
        return done("sites-missing", counts)
    err_txt = ", ".join(f"{e['err']:.1g}" for e in errs)

    # 3. generate (causal LMs)
    if generate is None:
        generate = registry == "causal-lm" and hasattr(model, "generate") and model.can_generate()
    if generate:
        try:
            with torch.no_grad():
                want = _generate(model, cfg)
        except Exception as e:  # noqa: BLE001
            det["generate"] = "eager generate fails: " + first_line(e)
            want = None
        if want is not None:
            try:
                with torch.no_grad():
                    got = _generate(fast, cfg)
            except Exception as e:  # noqa: BLE001
                return done("generate-error", first_line(e))
            if not torch.equal(got.sequences, want.sequences):
                return done("wrong-generate", f"greedy tokens differ: {got.sequences.tolist()} vs eager "
                                              f"{want.sequences.tolist()}")
            worst = (0.0, 0, 0)
            for step, (a, b) in enumerate(zip(got.logits, want.logits)):
                for row in range(a.shape[0]):
                    e = rel_err(a[row], b[row])
                    worst = max(worst, (e, step, row))
            det["generate_err"] = worst[0]
            if worst[0] >= TOL:
                return done("wrong-generate", f"tokens equal; logits of step {worst[1]}, row {worst[2]} differ "
                                              f"by {worst[0]:.2g}")
            det["generate"] = f"tokens equal, logits within {worst[0]:.1g}"
        # a decoding step under each sparse policy computes the last rows of the full forward, where the eager
        # model's own steps do (some decoders' generate feeds other inputs than a full forward: BERT as a
        # decoder, CPM-Ant)
        if "static" in decode and want is not None:
            status, det["static"] = _static_check(model, fast, cfg)
            if status is not None:
                return done(status, det["static"])
        decode = tuple(p for p in decode if p != "static")
        base = _decode_error(model, cfg, want) if decode else 0.0
        if base >= TOL:
            det["decode"] = f"not checked: eager's own generate differs from its full forward by {base:.2g}"
            decode = ()
        for pol in decode:
            try:
                torch._dynamo.reset()
                fast = attncomp.compile(model, policy=_decode_policy(pol))
                with torch.no_grad():
                    gen = _generate(fast, cfg)
                    if pol == "hash":  # the decoding steps' sites given the buckets the cache keeps (kvcache.py)
                        det["decode_hash_cached"] = _cached_bucket_sites(fast)
                    err = _decode_error(fast, cfg, gen)
            except ValueError as e:
                if "keeps entries by key position" not in str(e):
                    return done("wrong-decode", f"{pol}: " + first_line(e))
                # a cache whose window layers attncomp cannot give every key: refused with an error, not wrong
                return done("decode-refused", f"{pol}: " + first_line(e))
            except Exception as e:  # noqa: BLE001
                return done("wrong-decode", f"{pol}: " + first_line(e))
            det[f"decode_{pol}_err"] = err
            if err >= max(TOL, 10 * base):  # the eager steps' own rounding (BigBird's 9e-5) may sit near TOL
                return done("wrong-decode", f"{pol}: generate's step logits differ from the full forward's last rows "
                                            f"by {err:.2g}")

    # 4. training gradients
    if train:
        try:
            tmodel, _ = Z.build(registry, model_type, class_name)
            _no_dropout(tmodel).train()
            tfast = attncomp.compile(tmodel, policy="dense")
            x, valid = inputs[0]
            proj, grads = None, []
            for run in (tmodel, tfast):
                tmodel.zero_grad(set_to_none=True)
                out = next(t for t in tensors(run(**x)) if t.is_floating_point() and t.requires_grad)
                if proj is None:
                    proj = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
                (out * proj).sum().backward()
                grads.append({k: p.grad.clone() for k, p in tmodel.named_parameters() if p.grad is not None})
        except Exception as e:  # noqa: BLE001
            return done("wrong-grad", "training: " + first_line(e))
        want_g, got_g = grads
        if want_g.keys() != got_g.keys():
            return done("wrong-grad", f"{len(got_g)} parameters got gradients, eager {len(want_g)}")
        scale = max(g.norm() for g in want_g.values())
        worst = max((float((got_g[k] - want_g[k]).norm() / scale), k) for k in want_g)
        det["grad_err"] = worst[0]
        if worst[0] >= TOL:
            return done("wrong-grad", f"gradient of {worst[1]} differs: {worst[0]:.2g} of the largest gradient's norm")
        det["train"] = f"gradients within {worst[0]:.1g}"
    dec = [f"{p} {det[f'decode_{p}_err']:.1g}" + (f" ({det['decode_hash_cached']} decoding-step sites took the "
                                                   f"cache's buckets)" if p == "hash" and "decode_hash_cached" in det
                                                   else "")
           for p in DECODE_POLICIES if f"decode_{p}_err" in det]
    dec_txt = f"; decoding steps vs full forward: {', '.join(dec)}" if dec else (
        f"; decoding steps {det['decode']}" if "decode" in det and det["decode"].startswith("not checked") else "")
    if "static" in det:
        dec_txt += f"; {det['static']}"
    return done("pass", f"{counts}; rel. err {err_txt}{dec_txt}")


def serve():
    """Run checks for the runner, one per line of stdin (JSON: registry, model_type, out, train), until
    stdin closes; after each, write the result to ``out`` and ``done`` to the protocol stream (the
    original stdout; the models' own prints go to stderr). Dynamo's caches are cleared between families."""
    import gc

    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    for line in sys.stdin:
        task = json.loads(line)
        torch._dynamo.reset()
        res = check(task["registry"], task["model_type"], train=task.get("train", False),
                    decode=tuple(task.get("decode", ())))
        with open(task["out"], "w") as f:
            json.dump(res, f, indent=1, default=str)
        gc.collect()
        proto.write("done\n")
        proto.flush()


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("registry", nargs="?")
    ap.add_argument("model_type", nargs="?")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--decode", default="", help=f"comma-separated checks of {DECODE_CHECKS}: static (an initialised "
                                                 "static cache), or sparse policies whose decoding steps are checked "
                                                 "against the full forward")
    ap.add_argument("--serve", action="store_true", help="read tasks from stdin (the runner's workers)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    if args.serve:
        return serve()
    if not (args.registry and args.model_type and args.out):
        ap.error("REGISTRY MODEL_TYPE OUT are required without --serve")
    res = check(args.registry, args.model_type, train=args.train, decode=tuple(p for p in args.decode.split(",") if p))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
