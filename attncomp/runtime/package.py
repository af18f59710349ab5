"""The ahead-of-time package format (``.acpkg``): an exported program that loads without pickle.

Why not ``torch.export.save``/``load``: in torch 2.13, ``torch.export.load`` reads tensor
subclasses and custom objects with ``torch.load(weights_only=False)`` and ``pickle.loads``, falls back
to ``weights_only=False`` for example inputs, and its own documentation warns never to load an
untrusted file. DESIGN.md §7 asks that loading a package never unpickles untrusted data, so this
format keeps torch's JSON serialisation of the graph and stores every tensor as raw bytes.

A package is a zip archive holding exactly:

- ``manifest.json``: format name and version, attncomp/torch/export-schema versions, byte order,
  ``entries`` (name -> sha256 and size of every other file) and the caller's ``meta`` (site specs,
  the compile report...).
- ``program.json``: the graph, signature and range constraints, as ``torch._export.serde`` writes
  them (no state dict, no constants, no example inputs: those are pickles there).
- ``tensors.json``: for every parameter, buffer, constant and example input: the name of its tensor
  in ``tensors.safetensors``, dtype, shape and flags.
- ``tensors.safetensors``: every distinct tensor once (tied weights stay tied), in ``safetensors``
  (Hugging Face's pickle-free format: a JSON header of names, dtypes, shapes and offsets, then raw
  little-endian bytes).
- ``kernels/<cache key>/<file>`` (optional): compiled kernel artefacts (CUDA cubins with their launch
  metadata, built by ``python -m attncomp build-kernels`` or the TVM backend) under their runtime cache
  key; loading puts them into the runtime's disk cache, so the package runs on a GPU machine that
  cannot build them.

Format version 1 (``tensors/<i>.bin`` raw bytes, no kernels) is still read; any other version is
refused with a message saying which versions this attncomp reads.

Loading checks before deserialising anything: the archive is readable, the format version is known,
torch's major.minor matches the one that wrote the package, the entries are exactly those listed
(no extra file, in particular no pickle), and each entry's size and sha256 match the manifest.
Because a manifest can be rewritten along with the entries, the graph itself is also checked for the
only places where torch's deserialiser turns strings into code: operator targets (only ``aten``,
``prims``, ``higher_order``, ``attncomp`` ops and symbolic-shape arithmetic resolve), sympy
expressions (``sympify`` evaluates them) and guard code (compiled with ``exec`` by ``.module()``).
For authenticity, pass the digest :func:`save_package` returned as ``expected_digest``.

Any refusal raises :class:`PackageError` (a ``ValueError``) naming the entry and the reason.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import logging
import os
import re
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from .cache import atomic_write

log = logging.getLogger(__name__)

__all__ = ["save_package", "load_package", "read_manifest", "PackageError", "FORMAT_NAME", "FORMAT_VERSION"]

FORMAT_NAME = "attncomp-package"
FORMAT_VERSION = 2
#: versions :func:`load_package` reads
READ_VERSIONS = (1, 2)

MANIFEST = "manifest.json"
PROGRAM = "program.json"
TENSORS = "tensors.json"
SAFETENSORS = "tensors.safetensors"
_TENSOR_ENTRY = re.compile(r"^tensors/(0|[1-9][0-9]{0,8})\.bin$")  # format version 1
_TENSOR_KEY = re.compile(r"^t(0|[1-9][0-9]{0,8})$")
_KERNEL_ENTRY = re.compile(r"^kernels/([A-Za-z0-9_\-]{1,128})/([A-Za-z0-9_][A-Za-z0-9_.\-]{0,127})$")
_SAFETENSORS_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
                       "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2", "complex64")

# refuse before reading: a manifest or graph this large is not something save_package wrote
_MAX_JSON = 256 << 20
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed timestamps: the same program gives the same bytes

_DTYPES: Dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex64", "complex128", "int64", "int32",
                 "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn",
                 "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class PackageError(ValueError):
    """A package that cannot be loaded: unreadable, tampered, incompatible or unsafe."""


# ---------------------------------------------------------------------------------------------
# Saving.

def _versions() -> Dict[str, Any]:
    from torch._export.serde.schema import SCHEMA_VERSION

    from .._version import __version__

    return {"attncomp": __version__, "torch": torch.__version__,
            "export_schema": [int(SCHEMA_VERSION[0]), int(SCHEMA_VERSION[1])]}


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


class _TensorWriter:
    """Collects tensors as entries; one entry per distinct tensor object (tied weights stay tied)."""

    def __init__(self):
        self.tensors: Dict[str, torch.Tensor] = {}
        self._by_id: Dict[int, str] = {}
        self._keep: List[torch.Tensor] = []  # ids stay unique while the tensors are alive

    @staticmethod
    def check(what: str, t: Any) -> None:
        """Raise :class:`PackageError` if ``t`` cannot be stored as raw bytes."""
        if not isinstance(t, torch.Tensor):
            raise PackageError(f"{what}: only tensors can be packaged, got {type(t).__name__} "
                               "(custom objects would need pickle to load)")
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or type(t.data) is not torch.Tensor:
            raise PackageError(f"{what}: tensor subclass {type(t).__name__} cannot be packaged without pickle")
        if t.layout != torch.strided:
            raise PackageError(f"{what}: only strided (dense) tensors can be packaged, got {t.layout}")
        if str(t.dtype).replace("torch.", "") not in _SAFETENSORS_DTYPES:
            raise PackageError(f"{what}: dtype {t.dtype} is not supported by the package format")
        if t.device.type == "meta":
            raise PackageError(f"{what}: a meta tensor has no data to package")

    def add(self, what: str, t: Any) -> Dict[str, Any]:
        self.check(what, t)
        dname = str(t.dtype).replace("torch.", "")
        entry = self._by_id.get(id(t))
        if entry is None:
            entry = f"t{len(self._by_id)}"
            self._by_id[id(t)] = entry
            self._keep.append(t)
            self.tensors[entry] = t.detach().to("cpu").contiguous()
        return {"entry": entry, "dtype": dname, "shape": [int(s) for s in t.shape],
                "requires_grad": bool(t.requires_grad), "is_param": isinstance(t, torch.nn.Parameter),
                "device": str(t.device)}


def _example_inputs(ep, writer: _TensorWriter) -> Optional[Dict[str, Any]]:
    ex = getattr(ep, "example_inputs", None)
    if ex is None:
        return None
    try:
        args, kwargs = ex
        # check all first: a half-stored set would leave entries nothing refers to
        for i, a in enumerate(args):
            writer.check(f"example input {i}", a)
        for k, v in kwargs.items():
            if not isinstance(k, str):
                raise TypeError(k)
            writer.check(f"example input {k!r}", v)
        return {"args": [writer.add(f"example input {i}", a) for i, a in enumerate(args)],
                "kwargs": {k: writer.add(f"example input {k!r}", v) for k, v in kwargs.items()}}
    except (TypeError, ValueError, AttributeError):  # PackageError is a ValueError
        pass
    # example inputs only help re-tracing; nested or non-tensor ones are not worth a pickle
    log.info("package: example inputs are not a flat set of tensors; not stored")
    return None


def _tvm_site_kernels(program: bytes) -> Dict[str, bytes]:
    """Cached CUDA artefacts for the program's sites that run on the TVM backend."""
    from ..spec import AttentionSpec

    specs = []

    def walk(x):
        if isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
        elif isinstance(x, str) and x.startswith("{") and '"backend":"tvm"' in x:
            try:
                specs.append(AttentionSpec.from_json(x))
            except Exception:  # a string that only looks like a spec
                pass

    walk(json.loads(program))
    if not specs:
        return {}
    from .cubin import artefacts_for_specs

    return artefacts_for_specs(specs)


def save_package(path: Union[str, os.PathLike], exported_program: "torch.export.ExportedProgram",
                 meta: Optional[dict] = None, kernels: Optional[Dict[str, bytes]] = None) -> str:
    """Write ``exported_program`` and the JSON-serialisable ``meta`` to ``path`` (atomically).

    ``kernels`` maps ``"<cache key>/<file name>"`` to the bytes of a compiled kernel artefact; they
    travel in the package and land in the loading machine's kernel cache. By default (``None``) the
    package carries the CUDA kernels in this machine's cache that serve its ``backend="tvm"`` sites
    (built by ``python -m attncomp build-kernels``), so it runs on a GPU machine without TVM.

    Returns the package digest (sha256 of its manifest, which covers every entry): give it to
    :func:`load_package` as ``expected_digest`` to refuse any other package.
    """
    from torch.export import ExportedProgram
    from torch._export.serde.serialize import serialize

    if not isinstance(exported_program, ExportedProgram):
        raise TypeError(f"save_package expects a torch.export.ExportedProgram, got {type(exported_program).__name__}")
    meta = {} if meta is None else meta
    try:
        meta_json = json.loads(json.dumps(meta, sort_keys=True))
    except (TypeError, ValueError) as e:
        raise PackageError(f"meta must be JSON-serialisable: {e}") from None

    ep = exported_program
    writer = _TensorWriter()
    state_dict = {name: writer.add(f"state_dict[{name!r}]", t) for name, t in ep.state_dict.items()}
    constants = {name: writer.add(f"constant {name!r}", t) for name, t in ep.constants.items()}
    examples = _example_inputs(ep, writer)

    import inspect

    if "serialize_state_dict" in inspect.signature(serialize).parameters:
        art = serialize(ep, serialize_state_dict=False, serialize_constants=False, serialize_example_inputs=False)
    else:  # older torch pickles them too; only the graph JSON is kept, the pickles are dropped
        art = serialize(ep)
    program = art.exported_program
    # the serialiser collects torchbind objects as constants of its own; they only load via pickle
    n_custom = len(json.loads(program).get("graph_module", {}).get("graph", {}).get("custom_obj_values", {}))
    if n_custom:
        raise PackageError(f"the program holds {n_custom} custom (torchbind) objects; "
                           "they cannot be packaged without pickle")

    tensors_json = json.dumps({"state_dict": state_dict, "constants": constants, "example_inputs": examples},
                              sort_keys=True).encode()
    from safetensors.torch import save as _st_save

    if kernels is None:
        kernels = _tvm_site_kernels(program)

    payload: Dict[str, bytes] = {PROGRAM: program, TENSORS: tensors_json,
                                 SAFETENSORS: _st_save(writer.tensors) if writer.tensors else b""}
    for name, data in sorted((kernels or {}).items()):
        entry = f"kernels/{name}"
        if not _KERNEL_ENTRY.match(entry) or not isinstance(data, (bytes, bytearray)):
            raise PackageError(f"kernel artefact {name!r}: expected '<cache key>/<file name>' and bytes")
        payload[entry] = bytes(data)
    manifest = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "versions": _versions(),
        "byteorder": sys.byteorder,
        "entries": {name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                    for name, data in payload.items()},
        "meta": meta_json,
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True, indent=1).encode()

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in [(MANIFEST, manifest_bytes)] + list(payload.items()):
            info = zipfile.ZipInfo(name, date_time=_ZIP_DATE)
            # raw weights barely compress; storing them keeps loading a plain copy
            info.compress_type = zipfile.ZIP_STORED if _stored(name) else zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, buf.getvalue())
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    log.info("package: wrote %s (%d entries, %d bytes, digest %s)", path, len(payload) + 1, buf.tell(), digest[:16])
    return digest


# ---------------------------------------------------------------------------------------------
# Reading and verifying.

def _open_zip(path: Union[str, os.PathLike]) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path, "r")
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        raise PackageError(f"{os.fspath(path)}: not a readable attncomp package (truncated or not a zip "
                           f"archive): {e}") from None


def _read_entry(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: Optional[int] = None) -> bytes:
    if limit is not None and info.file_size > limit:
        raise PackageError(f"entry {info.filename!r}: {info.file_size} bytes, expected at most {limit}")
    try:
        with zf.open(info) as f:
            data = f.read(info.file_size + 1)
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, RuntimeError, ValueError, NotImplementedError) as e:
        raise PackageError(f"entry {info.filename!r} is damaged (tampered or truncated): {e}") from None
    if len(data) != info.file_size:
        raise PackageError(f"entry {info.filename!r} is damaged: {len(data)} bytes read, {info.file_size} declared")
    return data


def _load_json(name: str, data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise PackageError(f"entry {name!r} is not valid JSON: {e}") from None


def _check_manifest(m: Any, path: str, allow_version_mismatch: bool) -> None:
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise PackageError(f"{path}: manifest.json does not describe an {FORMAT_NAME}")
    fv = m.get("format_version")
    if fv not in READ_VERSIONS or isinstance(fv, bool):
        raise PackageError(f"{path}: package format version {fv!r} is not supported; this attncomp "
                           f"reads versions {', '.join(map(str, READ_VERSIONS))} and writes {FORMAT_VERSION} "
                           "(re-export the model with this attncomp)")
    v = m.get("versions")
    ents = m.get("entries")
    if not isinstance(v, dict) or not isinstance(ents, dict) or not isinstance(m.get("meta", {}), dict):
        raise PackageError(f"{path}: manifest.json is malformed (versions/entries/meta)")
    if m.get("byteorder") != sys.byteorder:
        raise PackageError(f"{path}: package written on a {m.get('byteorder')}-endian machine, "
                           f"this one is {sys.byteorder}-endian")
    saved = str(v.get("torch", ""))
    here = torch.__version__
    if saved.split(".")[:2] != here.split(".")[:2]:
        msg = (f"{path}: package written with torch {saved}, this is torch {here}: "
               "exported programs are only loaded by the torch major.minor that wrote them")
        if not allow_version_mismatch:
            raise PackageError(msg + " (pass allow_version_mismatch=True to try anyway)")
        log.warning("%s; loading anyway as asked", msg)
    from torch._export.serde.schema import SCHEMA_VERSION

    schema = v.get("export_schema")
    if not (isinstance(schema, list) and schema and schema[0] == SCHEMA_VERSION[0]):
        raise PackageError(f"{path}: export schema {schema!r} is incompatible with this torch's {list(SCHEMA_VERSION)}")


def _verified_entries(zf: zipfile.ZipFile, manifest: dict) -> Dict[str, bytes]:
    infos = zf.infolist()
    names = [i.filename for i in infos]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise PackageError(f"entries {dup} appear more than once in the archive")
    listed = manifest["entries"]
    v1 = manifest.get("format_version") == 1
    for name in listed:
        if name in (PROGRAM, TENSORS) or (_TENSOR_ENTRY.match(name) if v1 else
                                          (name == SAFETENSORS or _KERNEL_ENTRY.match(name))):
            continue
        raise PackageError(f"entry {name!r} is not part of the {FORMAT_NAME} format version "
                           f"{manifest.get('format_version')} (it holds only JSON, tensors and kernel "
                           "artefacts, never pickled data); refusing the package")
    present = set(names) - {MANIFEST}
    extra = sorted(present - set(listed))
    if extra:
        raise PackageError(f"unexpected entries {extra} not listed in manifest.json (the format holds no pickled "
                           "or executable data); refusing the package")
    missing = sorted(set(listed) - present)
    required = [PROGRAM, TENSORS] + ([] if v1 else [SAFETENSORS])
    if missing or any(r not in listed for r in required):
        raise PackageError(f"entries {missing or required} are missing from the package")
    out: Dict[str, bytes] = {}
    by_name = {i.filename: i for i in infos}
    for name, rec in listed.items():
        if not (isinstance(rec, dict) and isinstance(rec.get("size"), int) and isinstance(rec.get("sha256"), str)):
            raise PackageError(f"manifest.json: record of entry {name!r} is malformed")
        info = by_name[name]
        if info.file_size != rec["size"]:
            raise PackageError(f"entry {name!r}: size {info.file_size} does not match the manifest's "
                               f"{rec['size']} (tampered or truncated)")
        # bound what reading can allocate: tensors are stored uncompressed, so their size is bounded
        # by the file's; JSON may be compressed, up to a fixed limit
        if _stored(name) and (info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size):
            raise PackageError(f"entry {name!r}: tensor and kernel data must be stored uncompressed")
        data = _read_entry(zf, info, None if _stored(name) else _MAX_JSON)
        if hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise PackageError(f"entry {name!r}: sha256 does not match the manifest (tampered or corrupt)")
        out[name] = data
    return out


def _stored(name: str) -> bool:
    """Entries written uncompressed (their size bounds what reading them allocates)."""
    return name.endswith(".bin") or name == SAFETENSORS or name.startswith("kernels/")


def read_manifest(path: Union[str, os.PathLike]) -> dict:
    """The manifest of a package (format, versions, entries, meta), without loading the program."""
    with _open_zip(path) as zf:
        return _manifest(zf, os.fspath(path))[0]


def _manifest(zf: zipfile.ZipFile, path: str) -> Tuple[dict, bytes]:
    try:
        info = zf.getinfo(MANIFEST)
    except KeyError:
        hint = ""
        if any(n.endswith(("data.pkl", ".pt")) or "/models/" in n or n.startswith("models/") for n in zf.namelist()):
            hint = " (this looks like a torch.export.save/torch.save archive, which loads through pickle)"
        raise PackageError(f"{path}: no manifest.json: not an attncomp package{hint}") from None
    raw = _read_entry(zf, info, _MAX_JSON)
    return _load_json(MANIFEST, raw), raw


# ---------------------------------------------------------------------------------------------
# Checks on the graph JSON: the strings torch's deserialiser evaluates.

_OP_NAMESPACES = ("aten", "prims", "higher_order", "attncomp")
# operator names: identifiers (``_to_copy``, ``_softmax``), or one of aten's dunder operators; other
# dunders (``__init__``) would reach Python attributes of the op namespace, not operators
_DUNDER_OPS = "|".join(f"__{n}__" for n in ("and", "or", "xor", "lshift", "rshift", "iand", "ior", "ixor",
                                              "ilshift", "irshift"))
_OP_TARGET = re.compile(r"^torch\.ops\.(%s)\.(?:(?!__)[A-Za-z_][A-Za-z0-9_]*|%s)(\.[A-Za-z_][A-Za-z0-9_]*)?$"
                        % ("|".join(_OP_NAMESPACES), _DUNDER_OPS))
_SYM_TARGETS = {f"_operator.{n}" for n in ("getitem", "eq", "ne", "le", "ge", "lt", "gt", "neg", "pos", "mul", "add",
                                            "sub", "floordiv", "mod", "pow", "truediv", "and_", "or_", "lshift",
                                            "rshift", "not_", "abs")} | \
               {f"math.{n}" for n in ("trunc", "ceil", "floor", "sqrt")} | \
               {f"torch.{n}" for n in ("sym_not", "sym_int", "sym_float", "sym_ite", "sym_max", "sym_min",
                                       "sym_sqrt", "sym_sum", "_sym_sqrt")}

# constructors sympy's srepr writes for shape expressions, and torch's symbolic-shape functions
_SYMPY_CALLS = {
    "Symbol", "Dummy", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Mod", "Max", "Min", "Abs", "floor",
    "ceiling", "Equality", "Unequality", "StrictLessThan", "StrictGreaterThan", "LessThan", "GreaterThan", "Eq",
    "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Piecewise", "ExprCondPair", "Tuple", "FloorDiv",
    "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift",
    "PowByNatural", "FloatPow", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity", "OpaqueUnaryFn_sqrt", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or", "BitwiseFn_bitwise_xor",
}
_SYMPY_ATOMS = {"oo", "zoo", "nan", "int_oo", "true", "false", "True", "False", "None", "pi", "E"}
_SAFE_STR = re.compile(r"^[A-Za-z0-9_.+\-]{0,64}$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_ARITH = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow, ast.USub, ast.UAdd, ast.Not,
          ast.And, ast.Or, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE, ast.BitAnd, ast.BitOr,
          ast.LShift, ast.RShift, ast.Invert)


def _check_sympy_expr(s: Any, where: str) -> None:
    """Refuse an ``expr_str`` that is more than sympy constructors over numbers and symbol names."""
    if not isinstance(s, str) or len(s) > 100_000 or "__" in s:
        raise PackageError(f"{where}: unsafe symbolic expression {str(s)[:80]!r}")
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        raise PackageError(f"{where}: symbolic expression is not well-formed: {s[:80]!r}") from None
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Load, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
                               ast.Tuple, ast.keyword) + _ARITH)
        if isinstance(node, ast.Call):
            ok = isinstance(node.func, ast.Name) and node.func.id in _SYMPY_CALLS
        elif isinstance(node, ast.Name):
            ok = node.id in _SYMPY_CALLS or node.id in _SYMPY_ATOMS or bool(_IDENT.match(node.id))
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (int, float, bool, type(None))) or \
                (isinstance(node.value, str) and bool(_SAFE_STR.match(node.value)))
        elif isinstance(node, ast.keyword):
            ok = node.arg is not None and bool(_IDENT.match(node.arg)) and isinstance(node.value, ast.Constant)
        if not ok:
            raise PackageError(f"{where}: symbolic expression contains {type(node).__name__}, which shape "
                               f"expressions never do: {s[:80]!r}")


# min/max/abs: the builtins torch 2.11's export writes into shape guards (pure functions of sizes)
_GUARD_NAMES = {"L", "inf", "IsNonOverlappingAndDenseIndicator", "cast_symbool_to_symint_guardless", "min", "max",
                "abs"}
_GUARD_TENSOR_ATTRS = {"size", "stride", "storage_offset", "dim", "numel"}
_GUARD_MATH = {"isnan", "isinf", "floor", "ceil", "trunc", "sqrt", "inf", "nan"}
_GUARD_TORCH = {"sym_not", "sym_int", "sym_float", "sym_ite", "sym_max", "sym_min", "sym_sqrt"}


def _check_guard(s: Any, where: str) -> None:
    """Refuse guard code that is more than comparisons of input sizes (``.module()`` execs it)."""
    if not isinstance(s, str) or len(s) > 10_000 or "__" in s or any(c in s for c in "\n\r#\"\\;"):
        raise PackageError(f"{where}: unsafe guard code {str(s)[:80]!r}")
    try:
        tree = ast.parse(s, mode="eval")
    except SyntaxError:
        raise PackageError(f"{where}: guard code is not an expression: {s[:80]!r}") from None
    allowed_bases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base == "math":
                ok = node.attr in _GUARD_MATH
            elif base == "torch":
                ok = node.attr in _GUARD_TORCH
            else:
                ok = node.attr in _GUARD_TENSOR_ATTRS
            if ok and base in ("math", "torch"):
                allowed_bases.add(id(node.value))
        elif isinstance(node, ast.Name):
            ok = node.id in _GUARD_NAMES or id(node) in allowed_bases
        elif isinstance(node, ast.Call):
            ok = isinstance(node.func, (ast.Attribute, ast.Name)) and not node.keywords
        elif isinstance(node, ast.Constant):
            ok = isinstance(node.value, (int, float, bool, type(None))) or \
                (isinstance(node.value, str) and bool(_IDENT.match(node.value)))
        else:
            ok = isinstance(node, (ast.Expression, ast.Load, ast.Compare, ast.BoolOp, ast.BinOp, ast.UnaryOp,
                                   ast.Subscript, ast.Tuple) + _ARITH)
        if not ok:
            raise PackageError(f"{where}: guard code contains {type(node).__name__}, which shape guards never "
                               f"do: {s[:80]!r}")


def _check_program(obj: Any, path: str = "program.json") -> None:
    """Walk the graph JSON; check every operator target and symbolic expression; drop stack traces."""
    stack = [(obj, path)]
    while stack:
        o, where = stack.pop()
        if isinstance(o, dict):
            if "target" in o:  # only graph nodes have a target in the export schema
                t = o["target"]
                if not isinstance(t, str) or not (_OP_TARGET.match(t) or t in _SYM_TARGETS):
                    raise PackageError(f"{PROGRAM}: node calls {str(t)[:80]!r}, which is not an aten/prims/"
                                       f"higher_order/attncomp operator or shape arithmetic; refusing the package")
                md = o.get("metadata")
                if isinstance(md, dict):
                    # only ever shown in generated code and messages; never worth trusting
                    md.pop("stack_trace", None)
            for k, v in o.items():
                if k == "expr_str":
                    _check_sympy_expr(v, f"{PROGRAM}: {where}")
                elif k == "guards_code":
                    if not isinstance(v, list):
                        raise PackageError(f"{PROGRAM}: guards_code must be a list")
                    for g in v:
                        _check_guard(g, f"{PROGRAM}: guard")
                elif isinstance(v, (dict, list)):
                    stack.append((v, f"{where}/{k}"))
        elif isinstance(o, list):
            stack.extend((v, where) for v in o)


#: libraries whose output classes (pytree nodes such as Hugging Face ``ModelOutput``) may be imported
#: by name on load; nothing from the package itself is ever imported or run
_OUTPUT_TYPE_LIBRARIES = ("transformers.",)
_TYPE_NAME = re.compile(r"(?<![A-Za-z0-9_.])((?:%s)[A-Za-z0-9_.]+)\.[A-Za-z_][A-Za-z0-9_]*" %
                        "|".join(re.escape(p) for p in _OUTPUT_TYPE_LIBRARIES))


def _import_output_types(program_json: bytes) -> None:
    """Import the installed library modules that define the exported program's input/output classes,
    so their pytree registrations exist in a fresh process."""
    import importlib

    text = program_json.decode("utf-8", errors="replace")
    for mod in sorted(set(_TYPE_NAME.findall(text))):
        try:
            importlib.import_module(mod)
        except Exception:  # not a module (e.g. a class path prefix) or not installed: deserialising will say
            continue


def _check_operators_exist(program: dict) -> None:
    """Every ``torch.ops`` target must resolve now: an unknown op would deserialise as a string."""
    missing = set()
    stack = [program]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            t = o.get("target")
            if isinstance(t, str) and t.startswith("torch.ops."):
                parts = t.split(".")[2:]
                obj = torch.ops
                try:
                    for p in parts:
                        obj = getattr(obj, p)
                except (AttributeError, RuntimeError):
                    missing.add(t)
            stack.extend(v for v in o.values() if isinstance(v, (dict, list)))
        elif isinstance(o, list):
            stack.extend(v for v in o if isinstance(v, (dict, list)))
    if missing:
        raise PackageError(f"{PROGRAM}: operators {sorted(missing)} are not registered in this process "
                           "(is the library that defines them imported, and is it the version that wrote the package?)")


# ---------------------------------------------------------------------------------------------
# Tensors.

def _safetensors(data: bytes) -> Dict[str, torch.Tensor]:
    """The tensors of a safetensors blob (its header is JSON; nothing is unpickled)."""
    if not data:
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load as _st_load

    try:
        out = _st_load(data)
    except (SafetensorError, ValueError, RuntimeError, OverflowError) as e:
        raise PackageError(f"entry {SAFETENSORS!r} is not a valid safetensors file: {e}") from None
    bad = sorted(k for k in out if not _TENSOR_KEY.match(k))
    if bad:
        raise PackageError(f"entry {SAFETENSORS!r} holds tensors {bad[:5]} that this format does not name")
    return out


def _make_tensor(desc: Any, entries: Dict[str, Any], what: str, device) -> torch.Tensor:
    if not isinstance(desc, dict):
        raise PackageError(f"{TENSORS}: {what} is malformed")
    entry, dname, shape = desc.get("entry"), desc.get("dtype"), desc.get("shape")
    if isinstance(entries.get(entry), torch.Tensor) and _TENSOR_KEY.match(str(entry)):
        t = entries[entry]
        if dname not in _DTYPES:
            raise PackageError(f"{TENSORS}: {what} has unsupported dtype {dname!r}")
        if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                for s in shape)):
            raise PackageError(f"{TENSORS}: {what} has an invalid shape {shape!r}")
        if str(t.dtype).replace("torch.", "") != dname or list(t.shape) != shape:
            raise PackageError(f"{SAFETENSORS}: tensor {entry!r} of {what} is {t.dtype} {list(t.shape)}, which "
                               f"does not match {TENSORS}'s {dname} {shape}")
        if t.dtype == torch.bool and t.numel() and bool((t.view(torch.uint8) > 1).any()):
            raise PackageError(f"{SAFETENSORS}: bool tensor {what} holds values other than 0 and 1")
        return _finish_tensor(t.clone(), desc, device)
    if entry not in entries or not _TENSOR_ENTRY.match(str(entry)):
        raise PackageError(f"{TENSORS}: {what} refers to entry {entry!r}, which the package does not hold")
    if dname not in _DTYPES:
        raise PackageError(f"{TENSORS}: {what} has unsupported dtype {dname!r}")
    if not (isinstance(shape, list) and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
        raise PackageError(f"{TENSORS}: {what} has an invalid shape {shape!r}")
    dtype = _DTYPES[dname]
    data = entries[entry]
    numel = 1
    for s in shape:
        numel *= s
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != len(data):
        raise PackageError(f"entry {entry!r}: {len(data)} bytes cannot hold {what} of shape {shape} and dtype {dname}")
    if numel == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        # bytearray: a private, writable copy (frombuffer shares memory with the buffer given)
        t = torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)
        if dtype == torch.bool and bool((t.view(torch.uint8) > 1).any()):
            raise PackageError(f"entry {entry!r}: bool tensor {what} holds values other than 0 and 1")
    return _finish_tensor(t, desc, device)


def _finish_tensor(t: torch.Tensor, desc: dict, device) -> torch.Tensor:
    dev = device if device is not None else _saved_device(desc.get("device"))
    if dev is not None and torch.device(dev) != t.device:
        t = t.to(dev)
    if desc.get("is_param"):
        return torch.nn.Parameter(t, requires_grad=bool(desc.get("requires_grad")))
    return t.requires_grad_(bool(desc.get("requires_grad"))) if t.is_floating_point() or t.is_complex() else t


def _saved_device(dev: Any) -> Optional[str]:
    """The device a tensor was saved from, when this machine has it; else CPU."""
    if not isinstance(dev, str):
        return None
    try:
        d = torch.device(dev)
    except (RuntimeError, ValueError):
        return None
    if d.type == "cuda" and torch.cuda.is_available():
        return dev
    if d.type not in ("cpu",):
        log.info("package: tensor saved on %s is loaded on the CPU (no such device here)", dev)
    return None


def _tensors(doc: Any, entries: Dict[str, bytes], device):
    if not isinstance(doc, dict):
        raise PackageError(f"{TENSORS} is malformed")
    made: Dict[str, torch.Tensor] = {}

    def get(desc, what):
        # one tensor object per entry, so tied weights come back tied
        key = desc.get("entry") if isinstance(desc, dict) else None
        if key in made and isinstance(desc, dict):
            return made[key]
        t = _make_tensor(desc, entries, what, device)
        made[key] = t
        return t

    sd, consts = doc.get("state_dict", {}), doc.get("constants", {})
    if not isinstance(sd, dict) or not isinstance(consts, dict):
        raise PackageError(f"{TENSORS}: state_dict/constants are malformed")
    state_dict = {str(k): get(v, f"state_dict[{k!r}]") for k, v in sd.items()}
    constants = {str(k): get(v, f"constant {k!r}") for k, v in consts.items()}
    examples = None
    ex = doc.get("example_inputs")
    if isinstance(ex, dict) and isinstance(ex.get("args"), list) and isinstance(ex.get("kwargs"), dict):
        examples = (tuple(get(a, f"example input {i}") for i, a in enumerate(ex["args"])),
                    {str(k): get(v, f"example input {k!r}") for k, v in ex["kwargs"].items()})
    used = {d.get("entry") for d in list(sd.values()) + list(consts.values()) if isinstance(d, dict)}
    if isinstance(ex, dict):
        descs = list(ex.get("args", [])) + list(ex.get("kwargs", {}).values())
        used |= {d.get("entry") for d in descs if isinstance(d, dict)}
    unused = sorted(n for n in entries if (_TENSOR_ENTRY.match(n) or _TENSOR_KEY.match(n)) and n not in used)
    if unused:
        raise PackageError(f"entries {unused} are not referenced by {TENSORS}; refusing the package")
    return state_dict, constants, examples


# ---------------------------------------------------------------------------------------------
# Loading.

def _install_kernels(entries: Dict[str, bytes]) -> None:
    """Put the package's kernel artefacts into the runtime's disk cache (verified entries only)."""
    from .cache import default_cache

    store = default_cache()
    for name, data in entries.items():
        m = _KERNEL_ENTRY.match(name)
        if m and store.enabled:
            store.put(m.group(1), m.group(2), data)

def load_package(path: Union[str, os.PathLike], *, map_location: Optional[Union[str, torch.device]] = None,
                 expected_digest: Optional[str] = None, allow_version_mismatch: bool = False
                 ) -> Tuple["torch.export.ExportedProgram", dict]:
    """Load ``(exported_program, meta)`` from a package written by :func:`save_package`.

    Never unpickles: the graph is JSON checked as described in the module docstring, tensors are raw
    bytes. ``map_location`` moves the program and its tensors to a device (torch's
    ``move_to_device_pass``); by default tensors go back to the device they were saved from when it
    exists here, else to the CPU. ``expected_digest`` (from :func:`save_package`) refuses any package
    but that one. ``allow_version_mismatch`` loads a package written by another torch major.minor
    (the export schema's major version must still match). Raises :class:`PackageError`.
    """
    import attncomp.ops  # noqa: F401  registers attncomp::attention, which the graph calls

    spath = os.fspath(path)
    with _open_zip(path) as zf:
        manifest, raw_manifest = _manifest(zf, spath)
        if expected_digest is not None and hashlib.sha256(raw_manifest).hexdigest() != expected_digest.lower():
            raise PackageError(f"{spath}: manifest digest does not match the expected {expected_digest[:16]}...; "
                               "this is not the package that was exported")
        _check_manifest(manifest, spath, allow_version_mismatch)
        entries = _verified_entries(zf, manifest)

    program = _load_json(PROGRAM, entries[PROGRAM])
    if not isinstance(program, dict) or not isinstance(program.get("graph_module"), dict):
        raise PackageError(f"entry {PROGRAM!r} does not hold an exported program")
    _check_program(program)
    _check_operators_exist(program)
    pool: Dict[str, Any] = dict(entries)
    if manifest.get("format_version") != 1:
        pool = {n: d for n, d in entries.items() if n in (PROGRAM, TENSORS)}
        pool.update(_safetensors(entries[SAFETENSORS]))
    state_dict, constants, examples = _tensors(_load_json(TENSORS, entries[TENSORS]), pool,
                                               None if map_location is None else torch.device(map_location))
    _install_kernels(entries)

    from torch._export.serde.serialize import SerializedArtifact, deserialize

    _import_output_types(entries[PROGRAM])
    artifact = SerializedArtifact(json.dumps(program).encode(), state_dict, constants, examples)
    try:
        ep = deserialize(artifact)
    except PackageError:
        raise
    except Exception as e:
        raise PackageError(f"{spath}: the exported program could not be rebuilt: {type(e).__name__}: {e}") from e
    if map_location is not None:
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, torch.device(map_location))
    return ep, manifest.get("meta", {})
