"""Every kernel variant the validator and the benchmarks launch, compiled for sm_80 and sm_90.

No GPU needed: ``gpu_backend.aot`` compiles with Triton's own compiler and the ptxas in
the triton wheel. Compiling happens in one compiler process per test worker, started
without ``TRITON_INTERPRET`` (conftest turns the interpreter on in this process), with
Triton's cache in a temporary folder.

Each test reports registers and spills three ways: a line on stdout (``pytest -rA``),
``record_property`` (``--junitxml``) and pytest's cache
(``pytest --cache-show 'aot/**/*'`` after a run). ``python -m gpu_backend.aot`` prints the
same as one table.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
triton = pytest.importorskip("triton", reason="the GPU backend's kernels need triton")
tl = triton.language
if not hasattr(getattr(triton, "knobs", None), "nvidia"):
    pytest.skip("gpu_backend.aot needs triton.knobs (a newer triton)", allow_module_level=True)

from gpu_backend import aot  # noqa: E402

VARIANTS = aot.variants()
# Variants known to spill, keyed (name, arch), with the finding: strict xfails, so a fix
# shows up as XPASS (failing) and the entry gets deleted. A spill that is acceptable
# belongs in the variant's spill_ok instead. None at present.
KNOWN_SPILLS: dict[tuple[str, int], str] = {}


@pytest.fixture(scope="session")
def compiler(tmp_path_factory: pytest.TempPathFactory):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path_factory.mktemp("triton-cache"))}
    with aot.CompilerProcess([f"{Path(__file__).stem}:aot_variants"],
                             python_path=[Path(__file__).parent], env=env) as process:
        yield process


def _report(request: pytest.FixtureRequest, record_property: Any, result: aot.CompileResult) -> None:
    print(f"{result.name} sm_{result.arch}: {result.n_regs} registers, {result.n_spills} B "
          f"spilled, {result.stack_bytes} B stack, {result.shared_bytes} B shared, "
          f"{result.compile_s:.2f} s")
    for key, value in dataclasses.asdict(result).items():
        record_property(key, value)
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        cache.set(f"aot/sm_{result.arch}/{result.name}", dataclasses.asdict(result))


def _params() -> list[Any]:
    out = []
    for v in VARIANTS:
        for arch in aot.ARCHS:
            reason = KNOWN_SPILLS.get((v.name, arch))
            marks = [pytest.mark.xfail(reason=reason, strict=True)] if reason else []
            out.append(pytest.param(v, arch, marks=marks, id=f"{v.name}-sm{arch}"))
    return out


@pytest.mark.parametrize(("variant", "arch"), _params())
def test_variant_compiles_without_spills(variant, arch, compiler, request, record_property):
    result = compiler.compile(variant.name, arch)
    _report(request, record_property, result)
    assert result.n_regs <= aot.MAX_REGISTERS
    assert not result.problems(variant.spill_ok), (variant.name, arch, variant.used_by)


def test_known_spills_name_variants():
    names = {v.name for v in VARIANTS}
    assert [key for key in KNOWN_SPILLS if key[0] not in names or key[1] not in aot.ARCHS] == []


def test_variants_follow_the_split_heuristic():
    # kernel_bench's defaults (batch 1/16/64 x context 512/2048/8192, 32 kv heads): on 132
    # SMs batch 1 splits min(ceil(264 / 32), ceil(context / 256)) = 2, 8, 9; on 108 SMs
    # (A100) 2, 7, 7; batch >= 16 fills the card.
    bench = {v.name.rsplit("/s", 1)[1] for v in VARIANTS
             if v.name.startswith("paged/fp16/q32kv32/d128/bs16/bn128/")}
    assert sorted(bench, key=int) == ["1", "2", "7", "8", "9"]
    # The validator's 40 kv heads: batch 1 reaches ceil(264 / 40) = 7 splits.
    validate = [v.name for v in VARIANTS if v.name.startswith("contiguous/fp32/q40kv40/")]
    assert validate == [f"contiguous/fp32/q40kv40/d128/bn128/s{s}" for s in range(1, 8)]
    by_name = {v.name: v for v in VARIANTS}
    paged = by_name["paged/fp16/q40kv40/d128/bs16/bn128/s3"]
    assert paged.constexprs == {"GROUP": 1, "HEAD_DIM": 128, "BLOCK_G": 1, "BLOCK_D": 128,
                                "BLOCK_N": 128, "NUM_SPLITS": 3, "USE_DOT": False,
                                "DOT_PRECISION": "tf32", "BLOCK_SIZE": 16, "TILE_IN_BLOCK": False}
    assert paged.signature["part_ptr"] == "*fp32" and paged.attrs["stride_kh"]
    assert "num_q_heads" not in paged.attrs  # 40 is not a multiple of 16
    gqa = by_name["paged/fp32/q4kv2/d16/bs16/bn64/s1"].constexprs
    assert (gqa["USE_DOT"], gqa["BLOCK_G"], gqa["DOT_PRECISION"]) == (True, 16, "ieee")
    assert by_name["combine/fp16/d128/s9"].constexprs == {"HEAD_DIM": 128, "BLOCK_D": 128,
                                                           "NUM_SPLITS": 9, "BLOCK_S": 16}


# --------------------------------------------------------------------------- the checks can fail


@triton.jit
def _spilling_kernel(x_ptr, out_ptr, N: tl.constexpr):
    """Each thread of one warp keeps N / 32 = 512 fp32 values live across the reduction."""
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, x * tl.sum(x, axis=0))


@triton.jit
def _first_negative_kernel(x_ptr, out_ptr, n):
    """Index of the first negative entry: fine in the interpreter, but Triton has no ``break``."""
    found = -1
    for i in range(0, n):
        if tl.load(x_ptr + i) < 0:
            found = i
            break
    tl.store(out_ptr, found)


def aot_variants() -> list[dict[str, Any]]:
    """The compiler process loads these beside the project's variants (as dicts, the form
    the other kernel modules use)."""
    return [
        {"name": "test/spilling", "fn": _spilling_kernel,
         "signature": {"x_ptr": "*fp32", "out_ptr": "*fp32", "N": "constexpr"},
         "constexprs": {"N": 16384}, "num_warps": 1, "num_stages": 1},
        {"name": "test/first-negative-break", "fn": _first_negative_kernel,
         "signature": {"x_ptr": "*fp32", "out_ptr": "*i32", "n": "i32"}, "constexprs": {}},
    ]


@pytest.mark.parametrize("arch", aot.ARCHS)
def test_a_spilling_variant_is_caught(compiler, arch, request, record_property):
    result = compiler.compile("test/spilling", arch)
    _report(request, record_property, result)
    assert result.n_regs <= aot.MAX_REGISTERS < 512 and result.n_spills > 0
    assert result.problems(None) == [f"spills {result.n_spills} bytes (stores + loads); shrink "
                                     "the tiles or give the variant a spill_ok reason"]
    assert result.problems("a test of the check") == []


def test_what_the_interpreter_runs_the_compiler_can_reject(compiler):
    from gpu_backend import kernels

    if kernels._INTERPRETED:
        import torch

        out = torch.zeros(1, dtype=torch.int32)
        _first_negative_kernel[(1,)](torch.tensor([3.0, 1.0, -2.0, -5.0]), out, 4)
        assert out.item() == 2
    with pytest.raises(aot.CompileError, match=r"(?s)^test/first-negative-break \(sm_90\): .*Break"):
        compiler.compile("test/first-negative-break", 90)
    # The process survives a rejected kernel.
    assert compiler.compile("combine/fp16/d128/s2", 90).n_spills == 0


def test_compile_needs_a_jit_function():
    interpreted = dataclasses.replace(VARIANTS[0], fn=lambda: None)
    with pytest.raises(aot.CompileError, match="is not a JITFunction"):
        aot.compile_variant(interpreted, 90)
