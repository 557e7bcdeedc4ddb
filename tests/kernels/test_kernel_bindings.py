"""The native kernels' Python bindings against their one header, mlaserve/kernels/csrc/mls.h.

ctypes trusts what it is told: an argtypes list one entry short, or a Structure with two fields swapped, reads
the wrong bytes without an error. So every prototype in the header is held to the argtypes / restype that
kernels/native.py sets (count and type of each parameter), every struct in the header to its ctypes mirror
(field names and order as the header declares them, field types, and the sizes and offsets this compiler gives
them, which the library reports through mls_layout), the ABI version to the header's, and the type table to
gguf's block sizes.
"""

from __future__ import annotations

import ctypes
import inspect
import re

import pytest

from mlaserve.gguf.quants import GGML_TYPES
from mlaserve.kernels import native, native_build, native_layers

STATUS = native.status()
needs_native = pytest.mark.skipif(not STATUS.available, reason=f"native kernels unavailable: {STATUS.detail}")

SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "double": ctypes.c_double}


def header() -> str:
    """mls.h without its comments."""
    return re.sub(r"/\*.*?\*/", " ", native_build.HEADER.read_text(), flags=re.S)


def declarators(decl: str) -> list[tuple[str, str]]:
    """'const float *a, *b' -> [('a', 'const float *'), ('b', 'const float *')]: each name with its C type."""
    first, *rest = (p.strip() for p in decl.split(","))
    m = re.fullmatch(r"(.*?)\s*(\**)\s*(\w+)", first)
    assert m, f"cannot parse the declaration {decl!r}"
    base, out = m.group(1).strip(), [(m.group(3), f"{m.group(1).strip()} {m.group(2)}".strip())]
    for p in rest:
        m = re.fullmatch(r"(\**)\s*(\w+)", p)
        assert m, f"cannot parse {p!r} in {decl!r}"
        out.append((m.group(2), f"{base} {m.group(1)}".strip()))
    return out


def prototypes() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (return type, [(parameter, C type)]) for every function mls.h declares."""
    found = {}
    for ret, name, params in re.findall(r"([\w \t]+?\**)\s*\b(mls_\w+)\(([^()]*)\);", header()):
        params = " ".join(params.split())
        found[name] = (
            " ".join(ret.split()),
            [] if params == "void" else [x for p in params.split(",") for x in declarators(p)],
        )
    return found


def structs() -> dict[str, list[tuple[str, str]]]:
    """struct name -> [(field, C type)] in declaration order, for every typedef struct in mls.h."""
    found = {}
    for body, name in re.findall(r"typedef struct\s*\{(.*?)\}\s*(\w+)\s*;", header(), flags=re.S):
        found[name] = [f for decl in body.split(";") if decl.strip() for f in declarators(" ".join(decl.split()))]
    return found


def mirrors() -> dict[str, type[ctypes.Structure]]:
    """The ctypes Structures of the bindings, by the C struct each says it mirrors (_c_type_)."""
    found = {}
    for module in (native, native_layers):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, ctypes.Structure) and cls.__module__ == module.__name__:
                assert hasattr(cls, "_c_type_"), f"{module.__name__}.{cls.__name__} names no C struct (_c_type_)"
                found[cls._c_type_] = cls
    return found


class LayoutEntry(ctypes.Structure):
    """mls.h mls_layout_entry_t: the test's own mirror, held to the table it reads like the others."""

    _c_type_ = "mls_layout_entry_t"
    _fields_ = [
        ("type", ctypes.c_char_p),
        ("field", ctypes.c_char_p),
        ("offset", ctypes.c_int64),
        ("size", ctypes.c_int64),
    ]


def compiled_layout() -> dict[str, tuple[int, list[tuple[str, int, int]]]]:
    """struct -> (sizeof, [(field, offsetof, sizeof)]) as the library was compiled (mls_layout)."""
    n = ctypes.c_int64()
    at = native.library().mls_layout(ctypes.byref(n))
    out: dict[str, tuple[int, list[tuple[str, int, int]]]] = {}
    for e in (LayoutEntry * n.value).from_address(at):
        name = e.type.decode()
        if e.field is None:
            out[name] = (e.size, [])
        else:
            out[name][1].append((e.field.decode(), e.offset, e.size))
    return out


def ctype_matches(c_type: str, py_type: object, by_c: dict[str, type[ctypes.Structure]]) -> bool:
    if "*" in c_type:  # pointers travel as addresses; a typed pointer must point at the mirror of its struct
        if py_type is ctypes.c_void_p or (
            py_type is ctypes.c_char_p and c_type.replace("const", "").split() == ["char", "*"]
        ):
            return True
        target = c_type.replace("const", "").replace("*", "").strip()
        return getattr(py_type, "_type_", None) is by_c.get(target)
    c_type = c_type.replace("const", "").strip()
    return py_type is SCALARS.get(c_type) or py_type is by_c.get(c_type)


def test_the_library_builds_wherever_a_compiler_is():
    """Every native test skips when the library is unavailable: right on a machine without a C compiler (the engine
    then runs the torch path), wrong where the sources fail to compile, where a C error would turn hundreds of tests
    into skips and the suite would still pass. With a compiler on PATH the build must succeed; its error is the
    failure's message."""
    if native_build._compiler() is None:
        pytest.skip("no C compiler on PATH: the torch path is the engine's there, by design")
    assert STATUS.available, STATUS.detail


def test_the_header_parses_into_every_function_and_struct():
    """The parsers above see what the header declares (a regex that found nothing would pass every test below)."""
    protos, fields = prototypes(), structs()
    assert len(protos) == len(re.findall(r"\bmls_\w+\(", header())) >= 17
    assert protos["mls_gemm"][0] == "int" and len(protos["mls_gemm"][1]) == 16
    assert protos["mls_layout"] == ("const mls_layout_entry_t *", [("n", "int64_t *")])
    assert protos["mls_abi_version"] == ("int", [])
    assert set(fields) == {
        "mls_moe_block_t",
        "mls_lin_t",
        "mls_layer_t",
        "mls_decode_step_t",
        "mls_rows_t",
        "mls_layout_entry_t",
    }
    assert fields["mls_moe_block_t"][5:7] == [("gate_w", "const float *"), ("bias", "const float *")]
    assert fields["mls_layer_t"][17] == ("q_a", "mls_lin_t")


@needs_native
def test_every_prototype_has_its_argtypes_and_restype():
    lib, by_c = native.library(), mirrors()
    for name, (ret, params) in prototypes().items():
        fn = getattr(lib, name)  # exported: an AttributeError names a prototype the library lacks
        types = fn.argtypes or []
        assert len(types) == len(params), f"{name}: {len(params)} parameters in mls.h, {len(types)} argtypes"
        for i, ((pname, c_type), py_type) in enumerate(zip(params, types)):
            assert ctype_matches(c_type, py_type, by_c), f"{name} parameter {i} ({c_type} {pname}): argtype {py_type}"
        want = ctypes.c_void_p if "*" in ret else SCALARS[ret]
        assert fn.restype is want, f"{name} returns {ret} in mls.h, restype {fn.restype}"


@needs_native
def test_every_struct_mirror_has_the_header_fields_and_the_compiled_layout():
    by_c, layout, declared = {**mirrors(), "mls_layout_entry_t": LayoutEntry}, compiled_layout(), structs()
    assert set(by_c) == set(declared) == set(layout), "a struct without its mirror, or a mirror without its struct"
    for name, fields in declared.items():
        cls, (size, compiled) = by_c[name], layout[name]
        py_fields = [(f[0], f[1]) for f in cls._fields_]
        assert [f for f, _ in py_fields] == [f for f, _ in fields], f"{cls.__name__}: fields differ from mls.h {name}"
        assert [f for f, _, _ in compiled] == [f for f, _ in fields], f"csrc/layout.c lists {name}'s fields otherwise"
        assert ctypes.sizeof(cls) == size, f"{cls.__name__}: {ctypes.sizeof(cls)} bytes, {name} {size}"
        for (field, c_type), (_, py_type), (_, offset, fsize) in zip(fields, py_fields, compiled):
            assert ctype_matches(c_type, py_type, by_c), f"{cls.__name__}.{field}: {py_type} for {c_type}"
            got = getattr(cls, field)
            assert (got.offset, got.size) == (offset, fsize), f"{cls.__name__}.{field} at {got.offset}, C at {offset}"


@needs_native
def test_abi_version_and_type_table_agree_with_python():
    text = header()
    assert native_build.ABI_VERSION == int(re.search(r"#define MLS_ABI_VERSION (\d+)", text).group(1))
    assert native.library().mls_abi_version() == native_build.ABI_VERSION
    types = re.search(r"enum\s*\{([^}]*\bMLS_GGML_TYPES\b[^}]*)\}", text).group(1)  # the weight types' enum
    ids = {m.group(1): int(m.group(2)) for m in re.finditer(r"\bMLS_(\w+) = (\d+)", types)}
    assert (ids["FP8_E4M3"], ids["FP4_E2M1"], ids["INT4_PACKED"]) == (
        native.FP8_E4M3,
        native.FP4_E2M1,
        native.INT4_PACKED,
    )
    ggml = {name: i for name, i in ids.items() if i < ids["GGML_TYPES"]}
    assert len(ggml) == 23  # Q4_0 ... Q6_K, MXFP4, the i-quants and TQ1_0 / TQ2_0
    info = ctypes.c_int64 * 3
    int8 = set()
    for name, i in ggml.items():
        v = info()
        assert native.library().mls_type_info(i, ctypes.byref(v, 0), ctypes.byref(v, 8), ctypes.byref(v, 16)) == 0
        t = GGML_TYPES[i]
        assert (t.name, v[0], v[1]) == (name, t.type_size, t.block_size), f"type {i}: the C table says {list(v)}"
        if v[2] & 4:
            int8.add(i)
    assert int8 == native.Q8_ACTIVATION_TYPES
    v = info()
    assert native.library().mls_type_info(1, ctypes.byref(v, 0), ctypes.byref(v, 8), ctypes.byref(v, 16)) == -1


def included(path, seen=None) -> set:
    """The files path reaches through #include "..." (the library's sources: mls.c includes the others)."""
    seen = set() if seen is None else seen
    seen.add(path)
    for name in re.findall(r'^#include "([^"]+)"', path.read_text(), flags=re.M):
        nxt = (path.parent / name).resolve()
        if nxt not in seen:
            included(nxt, seen)
    return seen


def test_the_build_reads_every_csrc_file_and_its_cache_key_covers_each(tmp_path, monkeypatch):
    """No source under csrc/ is left out of the one translation unit, and a change to any of them (a header
    included in all, a file deep in a subfolder) gives another library: a cached build is never stale."""
    root = native_build.CSRC.resolve()
    files = sorted(p.resolve() for p in root.rglob("*") if p.is_file())
    assert set(files) == included(native_build.SOURCE.resolve())
    assert {p.relative_to(root).as_posix() for p in files} >= {"mls.h", "x86/avx2.c", "moe/block.c"}
    before = native_build._sources_digest()
    copy = tmp_path / "csrc"
    for p in files:
        (copy / p.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
        (copy / p.relative_to(root)).write_bytes(p.read_bytes())
    monkeypatch.setattr(native_build, "CSRC", copy)
    assert native_build._sources_digest() == before
    for p in files:
        target = copy / p.relative_to(root)
        target.write_bytes(p.read_bytes() + b"\n")
        assert native_build._sources_digest() != before, f"{p.name}: not in the cache key"
        target.write_bytes(p.read_bytes())
