"""Policies, ``AttentionSpec`` and the counter-based hash shared by every backend."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

import attncomp
from tests.utils import fresh_seed
from attncomp import policies as P
from attncomp.policy import POLICIES, get_policy, keep_mask, uniform_hash
from attncomp.spec import AttentionSpec

NAMES = ("dense", "dfss", "hash", "drop", "spion", "et")
CLASSES = {"dense": "Dense", "dfss": "DFSS", "hash": "Hash", "drop": "Drop", "spion": "SPION", "et": "ET"}



# ---------------------------------------------------------------------------------------------
# Registry and module layout.


def test_policies_module_exports_every_policy():
    for cls in CLASSES.values():
        c = getattr(P, cls)
        assert isinstance(c, type) and issubclass(c, P.Policy)
        assert getattr(attncomp, cls) is c
    import attncomp.policies as P2  # the documented import path is a real module path

    assert P2 is P


@pytest.mark.parametrize("name", NAMES)
def test_get_policy_by_name(name):
    pol = get_policy(name)
    assert type(pol) is getattr(P, CLASSES[name])
    assert pol.name == name
    assert get_policy(name.upper()) == pol
    assert attncomp.get_policy(name) == pol


@pytest.mark.parametrize("name", NAMES)
def test_get_policy_passes_instances_through(name):
    pol = getattr(P, CLASSES[name])()
    assert get_policy(pol) is pol


def test_get_policy_with_parameters():
    assert get_policy("dfss", n=1, m=8) == P.DFSS(1, 8)
    assert get_policy("hash", n_buckets=8, exclude_self=True) == P.Hash(n_buckets=8, exclude_self=True)
    assert get_policy(P.Drop(), q_rate=0.25) == P.Drop(q_rate=0.25)
    assert get_policy(None) == P.Dense()


def test_dfss_defaults_resolve_per_dtype():
    d = P.DFSS()
    assert (d.n, d.m) == (None, None)
    for dt in (torch.float16, torch.bfloat16):
        r = d.resolved(dt)
        assert (r.n, r.m) == (2, 4)
    for dt in (torch.float32, torch.float64):
        r = d.resolved(dt)
        assert (r.n, r.m) == (1, 2)
    # explicit n:m wins over the dtype default
    for dt in (torch.float16, torch.float32):
        assert P.DFSS(3, 8).resolved(dt) == P.DFSS(3, 8)


@pytest.mark.parametrize("m", (2, 4, 8, 16))
def test_dfss_every_valid_n_m(m):
    for n in range(1, m):
        p = P.DFSS(n, m)
        assert (p.n, p.m) == (n, m)


def test_other_defaults():
    assert P.Hash().n_buckets >= 2 and P.Hash().exclude_self is False
    assert 0 <= P.Drop().q_rate < 1 and 0 <= P.Drop().k_rate < 1
    assert P.SPION().block_size in (16, 32, 64, 128)
    assert P.ET().fold_wv_wo in (True, False, "auto")


# ---------------------------------------------------------------------------------------------
# Invalid parameters: ValueError naming the valid choices.

INVALID = [
    ("DFSS(n=4, m=4)", lambda: P.DFSS(n=4, m=4), ("1 <= n < m",)),
    ("DFSS(n=0, m=4)", lambda: P.DFSS(n=0, m=4), ("1 <= n < m",)),
    ("DFSS(n=5, m=4)", lambda: P.DFSS(n=5, m=4), ("1 <= n < m",)),
    ("DFSS(2, 3)", lambda: P.DFSS(2, 3), ("2", "4", "8", "16")),
    ("DFSS(2, 32)", lambda: P.DFSS(2, 32), ("2", "4", "8", "16")),
    ("DFSS(n=2)", lambda: P.DFSS(n=2), ("m",)),
    ("DFSS(m=4)", lambda: P.DFSS(m=4), ("n",)),
    ("DFSS(n='2', m=4)", lambda: P.DFSS(n="2", m=4), ("1 <= n < m",)),
    ("Hash(n_buckets=0)", lambda: P.Hash(n_buckets=0), ("even", ">= 2")),
    ("Hash(n_buckets=3)", lambda: P.Hash(n_buckets=3), ("even", ">= 2")),
    ("Hash(n_buckets=4.0)", lambda: P.Hash(n_buckets=4.0), ("even", ">= 2")),
    ("Drop(q_rate=1.0)", lambda: P.Drop(q_rate=1.0), ("[0, 1)",)),
    ("Drop(k_rate=-0.1)", lambda: P.Drop(k_rate=-0.1), ("[0, 1)",)),
    ("Drop(q_rate=nan)", lambda: P.Drop(q_rate=float("nan")), ("[0, 1)",)),
    ("SPION(block_size=48)", lambda: P.SPION(block_size=48), ("16", "32", "64", "128")),
    ("SPION(filter_size=4)", lambda: P.SPION(filter_size=4), ("odd",)),
    ("SPION(threshold=1.5)", lambda: P.SPION(threshold=1.5), ("(0, 1)",)),
    ("SPION(threshold=None)", lambda: P.SPION(threshold=None), ("(0, 1)",)),
    ("ET(fold_wv_wo='x')", lambda: P.ET(fold_wv_wo="x"), ("True", "False", "auto")),
    ("get_policy('nope')", lambda: get_policy("nope"), NAMES),
    ("get_policy(3)", lambda: get_policy(3), NAMES),
    ("get_policy('dfss', bogus=1)", lambda: get_policy("dfss", bogus=1), ("bogus", "n", "m")),
    ("get_policy('hash', n=2)", lambda: get_policy("hash", n=2), ("n_buckets", "exclude_self", "seed")),
    ("get_policy(DFSS(), bogus=1)", lambda: get_policy(P.DFSS(), bogus=1), ("bogus", "n", "m")),
    ("get_policy('dfss', n=2)", lambda: get_policy("dfss", n=2), ("m",)),
]


@pytest.mark.parametrize("make,must_name", [(f, n) for _, f, n in INVALID], ids=[i for i, _, _ in INVALID])
def test_invalid_parameters_raise_value_error_naming_valid_choices(make, must_name):
    with pytest.raises(ValueError) as e:
        make()
    for s in must_name:
        assert s in str(e.value), f"{s!r} not named in {str(e.value)!r}"


# ---------------------------------------------------------------------------------------------
# Frozen and hashable.

SAMPLES = [P.Dense(), P.DFSS(), P.DFSS(2, 4), P.DFSS(1, 16), P.Hash(), P.Hash(n_buckets=8, exclude_self=True, seed=3),
           P.Drop(), P.Drop(q_rate=0.1, k_rate=0.2, seed=5), P.SPION(), P.SPION(block_size=16, filter_size=7),
           P.ET(), P.ET(reorder_scale=False, fold_wv_wo=True)]


@pytest.mark.parametrize("pol", SAMPLES, ids=lambda p: p.describe())
def test_policies_frozen_and_hashable(pol):
    field = dataclasses.fields(pol)[0].name if dataclasses.fields(pol) else "name"
    with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
        setattr(pol, field, getattr(pol, field))
    twin = type(pol)(**pol.params())
    assert twin == pol and hash(twin) == hash(pol)
    assert {pol: 1}[twin] == 1


def test_distinct_policies_differ():
    assert len(set(SAMPLES)) == len(SAMPLES)
    assert P.DFSS(2, 4) != P.DFSS(1, 4)
    assert P.Dense() != P.ET()
    assert P.Hash(seed=1) != P.Hash(seed=2)


@pytest.mark.parametrize("pol", SAMPLES, ids=lambda p: p.describe())
def test_policy_json_round_trip(pol):
    d = json.loads(json.dumps(pol.to_json()))
    assert d["name"] == pol.name
    name = d.pop("name")
    assert get_policy(name, **d) == pol
    assert pol.name in pol.describe()


def test_registry_is_complete():
    assert set(POLICIES) == set(NAMES)


# ---------------------------------------------------------------------------------------------
# AttentionSpec.


def _random_spec(g) -> AttentionSpec:
    r = lambda n: int(torch.randint(0, n, (1,), generator=g))  # noqa: E731
    pol = SAMPLES[r(len(SAMPLES))]
    return AttentionSpec(causal=bool(r(2)), mask_kind=("none", "bool", "float")[r(3)],
                         scale=(None, float(torch.rand((), generator=g, dtype=torch.float64)))[r(2)],
                         dropout_p=(0.0, 0.1)[r(2)], dtype=("float16", "bfloat16", "float32", "float64", None)[r(5)],
                         head_dim=(None, 64, 128)[r(3)], gqa_groups=1 + r(4), policy=pol,
                         backend=("auto", "reference", "triton")[r(3)])


def test_spec_json_round_trip_and_hashable():
    seed = fresh_seed()
    g = torch.Generator().manual_seed(seed)
    for _ in range(30):
        spec = _random_spec(g)
        js = spec.to_json()
        json.loads(js)
        back = AttentionSpec.from_json(js)
        assert back == spec and hash(back) == hash(spec), f"seed={seed}: {js}"
        assert back.to_json() == js and back.digest() == spec.digest()
        assert back.scale == spec.scale  # floats survive exactly
        assert type(back.policy) is type(spec.policy)
        assert {spec: 1}[back] == 1
        with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
            spec.causal = not spec.causal


def test_spec_digest_distinguishes_policies():
    digests = {AttentionSpec(policy=p).digest() for p in SAMPLES}
    assert len(digests) == len(SAMPLES)


@pytest.mark.parametrize("kw,named", [
    (dict(mask_kind="additive"), ("none", "bool", "float")),
    (dict(backend="cuda"), ("reference", "triton")),
    (dict(dropout_p=1.0), ("[0, 1)",)),
    (dict(dtype="float8"), ("float16", "float32")),
    (dict(policy="dense"), ("Policy",)),
])
def test_spec_invalid_values(kw, named):
    with pytest.raises(ValueError) as e:
        AttentionSpec(**kw)
    for s in named:
        assert s in str(e.value)


# ---------------------------------------------------------------------------------------------
# uniform_hash and the drawn keep masks.


def test_uniform_hash_deterministic_in_range_uniform():
    seed = fresh_seed()
    idx = torch.arange(200_000, dtype=torch.int64) + int(torch.randint(0, 2**40, (1,)))
    a = uniform_hash(seed, idx)
    b = uniform_hash(seed, idx.clone())
    assert torch.equal(a, b)
    assert a.dtype == torch.float32 and a.shape == idx.shape
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0
    assert abs(a.double().mean().item() - 0.5) < 0.005, f"seed={seed}"
    assert abs(a.double().var().item() - 1 / 12) < 0.003, f"seed={seed}"
    hist = torch.histc(a, bins=10, min=0.0, max=1.0) / a.numel()
    assert torch.all((hist - 0.1).abs() < 0.005), f"seed={seed}: {hist}"
    # neighbouring indices are not correlated
    x = a.double() - 0.5
    assert abs((x[1:] * x[:-1]).mean().item()) < 0.002, f"seed={seed}"
    c = uniform_hash(seed + 1, idx)
    assert (a != c).double().mean() > 0.99


def test_uniform_hash_matches_uint32_arithmetic():
    """The int64 emulation gives the bits a uint32 kernel (Triton) computes with wrapping arithmetic."""
    seed = fresh_seed()
    idx = torch.randint(-(2**40), 2**40, (5000,), dtype=torch.int64)
    got = uniform_hash(seed, idx)
    with np.errstate(over="ignore"):
        s = np.uint32((seed * 0x9E3779B1 + 0x7F4A7C15) & 0xFFFFFFFF)
        x = (idx.numpy() & 0xFFFFFFFF).astype(np.uint32) ^ s
        x = x * np.uint32(0x85EBCA6B)
        x ^= x >> np.uint32(13)
        x = x * np.uint32(0xC2B2AE35)
        x ^= x >> np.uint32(16)
        x = x * np.uint32(0x27D4EB2F)
        x ^= x >> np.uint32(15)
        want = (x >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))
    assert torch.equal(got, torch.from_numpy(want)), f"seed={seed}"
    # only the low 32 bits of the index matter
    assert torch.equal(uniform_hash(seed, idx), uniform_hash(seed, idx + (1 << 32)))


def test_keep_mask_rate_and_streams():
    seed = fresh_seed()
    rate = float(torch.rand(()) * 0.8 + 0.1)
    a = keep_mask((4, 8, 512), rate, seed, 0)
    assert a.dtype == torch.bool and a.shape == (4, 8, 512)
    assert abs(1 - a.double().mean().item() - rate) < 0.02, f"seed={seed}"
    assert torch.equal(a, keep_mask((4, 8, 512), rate, seed, 0))
    assert not torch.equal(a, keep_mask((4, 8, 512), rate, seed, 1))  # query and key draws differ
    assert not torch.equal(a, keep_mask((4, 8, 512), rate, seed + 1, 0))
