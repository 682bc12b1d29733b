"""Compile every Triton kernel variant the project launches, ahead of time, for real GPUs.

Triton's interpreter (``TRITON_INTERPRET=1``, how the kernels run without CUDA) accepts
code the GPU compiler rejects, and says nothing of registers. This module compiles each
variant with ``triton.compile`` for a :class:`GPUTarget` (sm_80, sm_90) on any machine:
Triton's frontend, LLVM and the ``ptxas`` bundled in the triton wheel need no GPU, no
driver and no CUDA toolkit.

A *variant* is one compiled kernel: a ``@triton.jit`` function with every constexpr
fixed, its argument types and the launch's specialisation (``D``: a pointer 16-byte
aligned, an int divisible by 16; Triton's launcher marks these and they decide whether
loads are vectorised, so leaving them out compiles a kernel no launch runs: the paged
kernel takes 255 registers and spills without them, ~100 with them).
:func:`variants` finds them by calling the real wrappers on meta tensors with the
kernels swapped for recorders (:mod:`gpu_backend.aot_launches`), so the planners
(``_plan``, ``_default_num_splits``) decide the constexprs as they do on a GPU:

* the validator on CUDA (``fragsim validate --device cuda``, ``benchmarks/gpu_check.py``
  part 1): 40 q / 40 kv heads, head_dim 128, block_size 16, fp16 and ``--dtype float32``,
  every split count the running batch and its lengths can produce;
* the kernel benchmark (``gpu_backend/kernel_bench.py``, gpu_check part 2): its default
  shape and batch × context grid, read from its signature;
* the interpreter's shapes (``fragsim validate --device cpu``, ``tests/test_kernels.py``'s
  split-K case), which ``FRAGSIM_TEST_CUDA=1`` runs on a GPU;
* the hybrid validator on CUDA (gpu_check part 4: the windowed kernel of every kind and
  MLA over a hybrid pool's pages, in :data:`gpu_backend.validate.CUDA_HYBRID_SHAPES`) and
  the windowed-kernel benchmark (:mod:`gpu_backend.window_bench`, gpu_check part 5);
* ``aot_variants()`` of :mod:`gpu_backend.kernels_window` and :mod:`gpu_backend.kernels_mla`
  where those modules exist (dicts with name, fn, signature, constexprs, num_warps,
  num_stages and optionally spill_ok, attrs), their names prefixed with the module's.

Split counts depend on the SM count; they are derived for the cards of
:data:`gpu_backend.aot_launches.NUM_SMS` and the union is compiled for every architecture.

Reading the output of ``python -m gpu_backend.aot [--arch 80,90] [--json] [--only TEXT]``
(one row per variant and architecture)::

    variant                                arch regs spills stack  smem  time
    paged/fp16/q40kv40/d128/bs16/bn64/s1  sm_90  102      0     0  1024  0.43

``regs``: registers per thread (255 is the hardware limit; above ~128 at 4 warps the SM
holds fewer programs). ``spills``: bytes of spill stores plus spill loads ptxas emitted
(static, per thread; not a run-time count); any spill fails unless the variant's
``spill_ok`` says why it is acceptable. ``stack``: the per-thread stack frame (spills and
local arrays). ``smem``: shared memory bytes per program. ``time``: seconds of this
compile (always a fresh compile, never Triton's cache). The exit status is 1 when a
variant fails to compile or spills unexcused.

Compiling happens in :class:`CompilerProcess`, a Python process started without
``TRITON_INTERPRET`` (which turns every ``@triton.jit`` into an interpreted function at
import), so it works from inside an interpreted test session.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from gpu_backend import aot_launches

ARCHS = (80, 90)
MAX_REGISTERS = 255
_EXTERNAL = ("gpu_backend.kernels_window", "gpu_backend.kernels_mla")


class CompileError(RuntimeError):
    """A variant that does not compile; the message starts with its name and arch."""


@dataclass(frozen=True)
class Variant:
    """One compiled kernel: ``signature`` maps every argument of ``fn`` to a Triton type
    (``*fp16``, ``i32``, ...) or ``constexpr``; ``constexprs`` gives the constexprs' values;
    ``attrs`` the launch's specialisation per argument, as Triton's attribute lists
    (``[["tt.divisibility", 16]]`` for a ``D``)."""

    name: str
    fn: Any
    signature: Mapping[str, str]
    constexprs: Mapping[str, Any]
    num_warps: int = 4
    num_stages: int = 3
    spill_ok: str | None = None  # why spilling is acceptable for this variant, if it is
    attrs: Mapping[str, list[list[Any]]] = field(default_factory=dict)
    used_by: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], prefix: str = "") -> Variant:
        """A variant from a kernel module's ``aot_variants()`` entry; ``attrs`` may also be
        keyed as ``ASTSource`` keys them, by ``(argument index,)``."""
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"variant {d.get('name')!r}: unknown keys {sorted(unknown)}")
        names = list(d["signature"])
        attrs = {names[k[0]] if isinstance(k, tuple) else k: v
                 for k, v in d.get("attrs", {}).items()}
        return cls(**{**d, "name": prefix + d["name"], "attrs": attrs,
                      "used_by": tuple(d.get("used_by", ()))})

    @classmethod
    def from_launch(cls, name: str, fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                    used_by: str) -> Variant:
        """The variant a launch ``fn[grid](*args, **kwargs)`` compiles, specialised as
        Triton's launcher does (the same ``specialize_impl``)."""
        params = inspect.signature(fn.fn).parameters
        values = {**dict(zip(params, args, strict=False)), **kwargs}
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[str, list[list[Any]]] = {}
        for arg, param in params.items():
            if "constexpr" in str(param.annotation):
                signature[arg], constexprs[arg] = "constexpr", values[arg]
                continue
            ty, spec = native_specialize_impl(BaseBackend, values[arg], False, True, True)
            signature[arg] = ty
            if ty == "constexpr":  # an int equal to 1 is specialised to a constant
                constexprs[arg] = spec
            elif spec:
                attrs[arg] = BaseBackend.parse_attr(spec)
        return cls(name, fn, signature, constexprs, kwargs.get("num_warps", 4),
                   kwargs.get("num_stages", 3), attrs=attrs, used_by=(used_by,))

    def inputs(self) -> tuple[Any, ...]:
        """Everything the compiled code depends on (two variants with equal inputs are one)."""
        return (self.fn, sorted(self.signature.items()), sorted(self.constexprs.items()),
                sorted(self.attrs.items()), self.num_warps, self.num_stages)


@dataclass(frozen=True)
class CompileResult:
    name: str
    arch: int
    n_regs: int        # registers per thread
    n_spills: int      # bytes of spill stores + spill loads (static, from ptxas -v)
    stack_bytes: int   # per-thread stack frame
    shared_bytes: int  # shared memory per program
    compile_s: float

    def problems(self, spill_ok: str | None) -> list[str]:
        out = []
        if self.n_regs > MAX_REGISTERS:
            out.append(f"{self.n_regs} registers > {MAX_REGISTERS}")
        if self.n_spills and not spill_ok:
            out.append(f"spills {self.n_spills} bytes (stores + loads); shrink the tiles or give "
                       "the variant a spill_ok reason")
        return out


# --------------------------------------------------------------------------- variants


def variants() -> list[Variant]:
    """Every variant the validator, the benchmarks and the interpreter tests launch, then
    those of the other kernel modules; one entry per name."""
    found = [Variant.from_launch(*launch) for launch in aot_launches.launches()]
    for module_name in _EXTERNAL:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                continue  # not written (yet): nothing to compile
            raise
        short = module_name.rsplit(".", 1)[-1]
        found += [Variant.from_dict({"used_by": (short,), **d}, short + ":")
                  for d in module.aot_variants()]
    return _merge(found)


def _merge(found: Iterable[Variant]) -> list[Variant]:
    """One variant per name and one per compiled kernel: a variant equal to an earlier one
    (another wrapper or module launching the same kernel) adds its users to that one."""
    by_name: dict[str, Variant] = {}
    name_of: dict[str, str] = {}  # repr(inputs) -> name
    for v in found:
        key = repr(v.inputs())
        name = name_of.setdefault(key, v.name)
        old = by_name.get(name)
        if old is None:
            by_name[name] = v
        elif old.inputs() != v.inputs():
            raise ValueError(f"two different variants are named {v.name!r}")
        else:
            used_by = old.used_by + tuple(u for u in v.used_by if u not in old.used_by)
            by_name[name] = dataclasses.replace(old, used_by=used_by)
    return list(by_name.values())


def load_variants(sources: Sequence[str] = ()) -> list[Variant]:
    """:func:`variants` plus those of each ``module:function`` in ``sources``."""
    found = variants()
    for source in sources:
        module_name, _, attr = source.partition(":")
        extra = getattr(importlib.import_module(module_name), attr)()
        found += [v if isinstance(v, Variant) else Variant.from_dict(v) for v in extra]
    return _merge(found)


# --------------------------------------------------------------------------- compiling

_REGS = re.compile(r"Used (\d+) registers")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def compile_variant(variant: Variant, arch: int) -> CompileResult:
    """Compile for ``sm_<arch>`` in this process (it must not run the interpreter).

    Always compiles afresh (Triton's cache would skip ptxas, whose ``-v`` report gives the
    registers and spills); raises :class:`CompileError` naming the variant."""
    where = f"{variant.name} (sm_{arch})"
    if not isinstance(variant.fn, JITFunction):
        raise CompileError(f"{where}: {variant.fn!r} is not a JITFunction; compile in a process "
                           "without TRITON_INTERPRET (CompilerProcess does)")
    names = list(variant.signature)
    attrs = {(names.index(a),): list(value) for a, value in variant.attrs.items()}
    src = ASTSource(variant.fn, dict(variant.signature), dict(variant.constexprs), attrs)
    options = {"num_warps": variant.num_warps, "num_stages": variant.num_stages}
    log = io.StringIO()
    t0 = time.perf_counter()
    with (triton.knobs.compilation.scope(), triton.knobs.nvidia.scope(),
          contextlib.redirect_stdout(log), warnings.catch_warnings()):
        triton.knobs.compilation.always_compile = True
        triton.knobs.nvidia.dump_ptxas_log = True  # printed, hence redirect_stdout
        warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
        try:
            kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        except Exception as exc:  # noqa: BLE001 - any compiler failure is this variant's
            raise CompileError(f"{where}: {type(exc).__name__}: {exc}") from exc
    seconds = time.perf_counter() - t0
    regs, frame = _REGS.search(log.getvalue()), _FRAME.search(log.getvalue())
    if regs is None or frame is None:
        raise CompileError(f"{where}: no ptxas resource report in the log:\n{log.getvalue()}")
    stack, stores, loads = (int(x) for x in frame.groups())
    return CompileResult(variant.name, arch, int(regs.group(1)), stores + loads, stack,
                         int(kernel.metadata.shared), round(seconds, 3))


class CompilerProcess:
    """``python -m gpu_backend.aot --serve`` without TRITON_INTERPRET: one compile per
    request, the variants found by :func:`load_variants` (``sources`` importable through
    ``python_path``), so its import cost is paid once. A compiler that crashes fails its
    request; the next request starts a fresh process."""

    def __init__(self, sources: Sequence[str] = (), python_path: Sequence[str | os.PathLike[str]] = (),
                 env: Mapping[str, str] | None = None) -> None:
        self._env = {k: v for k, v in (os.environ if env is None else env).items()
                     if k != "TRITON_INTERPRET"}
        paths = [str(p) for p in python_path]
        if paths:
            self._env["PYTHONPATH"] = os.pathsep.join(paths + [self._env.get("PYTHONPATH", "")])
        self._cmd = [sys.executable, "-m", "gpu_backend.aot", "--serve"]
        for source in sources:
            self._cmd += ["--source", source]
        self._proc: subprocess.Popen[str] | None = None
        self._log = tempfile.TemporaryFile("w+")

    def compile(self, name: str, arch: int) -> CompileResult:
        if self._proc is None or self._proc.poll() is not None:
            self._log.seek(0)
            self._log.truncate()
            self._proc = subprocess.Popen(self._cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=self._log, text=True, env=self._env)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        try:
            self._proc.stdin.write(json.dumps({"name": name, "arch": arch}) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._log.seek(0)
            raise CompileError(f"{name} (sm_{arch}): the compiler process exited "
                               f"({self._proc.wait()}):\n{self._log.read()[-4000:]}")
        reply = json.loads(line)
        if reply["driver_initialised"]:
            raise CompileError(f"{name} (sm_{arch}): compiling initialised a GPU driver; it "
                               "must not need one (CI has no GPU)")
        if "error" in reply:
            raise CompileError(reply["error"])
        return CompileResult(**reply["result"])

    def close(self) -> None:
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._proc.stdin.close()
            self._proc.wait()
        self._log.close()

    def __enter__(self) -> CompilerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(sources: Sequence[str]) -> int:
    from triton.runtime.driver import driver

    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else written to stdout (ptxas, prints) must not mix with replies
    by_name = {v.name: v for v in load_variants(sources)}
    for line in sys.stdin:
        request = json.loads(line)
        reply: dict[str, Any] = {}
        try:
            if request["name"] not in by_name:
                raise CompileError(f"{request['name']}: no such variant")
            result = compile_variant(by_name[request["name"]], int(request["arch"]))
            reply["result"] = dataclasses.asdict(result)
        except CompileError as exc:
            reply["error"] = str(exc)
        reply["driver_initialised"] = driver._default is not None or driver._active is not None
        replies.write(json.dumps(reply) + "\n")
    return 0


def compile_all(names: Sequence[str], archs: Sequence[int], jobs: int,
                sources: Sequence[str] = ()) -> list[CompileResult | CompileError]:
    """Every (name, arch), in that order, over ``jobs`` compiler processes."""
    tasks = [(name, arch) for name in names for arch in archs]
    results: list[CompileResult | CompileError | None] = [None] * len(tasks)
    cursor = iter(range(len(tasks)))  # shared by the threads; next() on it is atomic

    def work() -> None:
        with CompilerProcess(sources) as compiler:
            for i in cursor:
                try:
                    results[i] = compiler.compile(*tasks[i])
                except CompileError as exc:
                    results[i] = exc

    with ThreadPoolExecutor(jobs) as pool:
        for future in [pool.submit(work) for _ in range(min(jobs, len(tasks)))]:
            future.result()
    return [r for r in results if r is not None]


# --------------------------------------------------------------------------- command line


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_backend.aot", description=__doc__.split("\n")[0])
    p.add_argument("--arch", default=",".join(map(str, ARCHS)), help="comma list (default: %(default)s)")
    p.add_argument("--only", default="", help="variants whose name contains this text")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    p.add_argument("--source", action="append", default=[], metavar="MODULE:FUNCTION",
                   help="more variants, from a function returning Variants or dicts")
    p.add_argument("--json", action="store_true", help="one JSON list of rows on stdout")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        return _serve(args.source)
    chosen = [v for v in load_variants(args.source) if args.only in v.name]
    archs = [int(a) for a in args.arch.split(",") if a]
    results = compile_all([v.name for v in chosen], archs, max(1, args.jobs), args.source)
    rows = []
    for (variant, arch), res in zip([(v, a) for v in chosen for a in archs], results, strict=True):
        row: dict[str, Any] = {"variant": variant.name, "arch": arch, "used_by": list(variant.used_by)}
        if isinstance(res, CompileError):
            row["problems"] = [str(res)]
        else:
            row.update(dataclasses.asdict(res), problems=res.problems(variant.spill_ok),
                       spill_ok=variant.spill_ok)
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(rows)
    return 1 if any(r["problems"] for r in rows) else 0


def _print_table(rows: Sequence[Mapping[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title_justify="left", title=f"{len(rows)} compiles")
    for col in ("variant", "arch", "regs", "spills", "stack", "smem", "time"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    table.add_column("problems")
    for r in rows:
        cells = [f"sm_{r['arch']}"] + [str(r.get(k, "")) for k in
                                       ("n_regs", "n_spills", "stack_bytes", "shared_bytes")]
        note = "; ".join(r["problems"]).split("\n")[0] or (f"spill ok: {r['spill_ok']}"
                                                            if r.get("spill_ok") else "")
        table.add_row(r["variant"], *cells, f"{r.get('compile_s', 0):.2f}",
                      f"[red]{note}[/red]" if r["problems"] else note)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    console.print(table)


if __name__ == "__main__":
    # Run through the imported module, not __main__: variants from other modules must be
    # instances of the same Variant class.
    from gpu_backend import aot

    raise SystemExit(aot.main())
