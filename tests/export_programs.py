"""Runs `every_program.py`'s paths with each jitted program also exported for CUDA and TPU:
`python tests/export_programs.py DIR` (DIR a scratch folder) writes `DIR/exports.json`.
`tests/test_export.py` runs it and reads that file.

`jax.jit` is replaced, before `jaxformer` and `train` are imported, by `exporting_jit`: the
first time a program jitted in `jaxformer` or `train` is called, or lowered to be compiled ahead,
with a new signature (its
arguments' pytree structure, shapes and dtypes, and its static arguments), it is exported with
`jax.export.export(program, platforms=[platform])(*the same arguments)` for each platform of
`PLATFORMS` in turn, which lowers it for that platform (with its lowering rules, its Pallas
kernels too: `lax.platform_dependent` keeps that platform's branch alone) without a device;
then it runs on the CPU as before. A call made while another program is traced (its
arguments tracers) is part of that program, not a program of its own, and is not exported.

Each export is one record in `exports.json`: `{"program", "paths", "args", "platforms",
"error", "seconds"}`: `paths` the `every_program.py` paths that called that signature (as its `ran` names
them), `args` a short description of each argument (`strategy: Speculative(proposer=PromptLookup)`),
`platforms` those it was exported for, `error` None or why the export failed, `seconds` the
time the export took.
"""

import functools
import inspect
import json
import sys
import threading
import time
import traceback
import types
from pathlib import Path

import jax

PLATFORMS = ("cuda", "tpu")
REAL_JIT = jax.jit
RECORDS: list[dict] = []  # one per export, in the order they ran
_lock = threading.Lock()  # (the serving engine calls its programs on a thread of its own)
_called: dict[int, dict] = {}  # the records called in the path running now, by id


def disabled_checks() -> list:
    """The checks an export for "cuda" disables, as docs/long_context.md says ("Exporting a
    program"): Triton's custom call has no compatibility guarantee across jaxlib versions, so
    export refuses it unless told; these programs are lowered to be checked, not kept.
    (Read when exporting: `jaxformer` is imported only after `jax.jit` is replaced.)"""
    from jaxformer.kernels import CUDA_CUSTOM_CALL_TARGETS
    return [jax.export.DisabledSafetyCheck.custom_call(target) for target in CUDA_CUSTOM_CALL_TARGETS]


def program_name(fun) -> str:
    """`module:qualified.name` of a jitted function; a bound method is named by its object's class
    (`jaxformer.decoder:Decoder.apply`), a `functools.partial` by the function it binds."""
    if isinstance(fun, functools.partial):
        return f"partial({program_name(fun.func)})"
    owner = getattr(fun, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        return f"{type(owner).__module__}:{type(owner).__qualname__}.{fun.__name__}"
    return f"{getattr(fun, '__module__', '?')}:{getattr(fun, '__qualname__', type(fun).__qualname__)}"


def describe(value) -> str:
    """A short description of an argument: `int32[2, 4]` for an array, the class for anything
    else, with a flax dataclass's static fields (`DecodeRequest(max_new_tokens=6, num_beams=1)`)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}{list(value.shape)}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    fields = getattr(value, "__dataclass_fields__", {})
    static = [(name, getattr(value, name)) for name, field in fields.items()
              if field.metadata.get("pytree_node", True) is False]
    if not static:
        return type(value).__name__
    shown = [f"{name}={v!r}" if isinstance(v, (bool, int, float, str, type(None))) else f"{name}={type(v).__name__}"
             for name, v in static]
    return f"{type(value).__name__}({', '.join(shown)})"


class ExportingJit:
    """A `jax.jit` program that is also exported at each new signature it is called with.

    Args:
      fun: the function jitted.
      jit_options: `jax.jit`'s keyword arguments (static and donated arguments, shardings, ...).
    """

    def __init__(self, fun, jit_options: dict):
        self.jitted = REAL_JIT(fun, **jit_options)
        self.name = program_name(fun)
        try:
            self.signature = inspect.signature(fun)
        except (TypeError, ValueError):  # (a callable whose parameters Python cannot read)
            self.signature = None
        self.static_nums, self.static_names = self._static(jit_options)
        self.seen: dict = {}  # signature -> its record
        functools.update_wrapper(self, fun)

    def _static(self, jit_options: dict) -> tuple[set[int], set[str]]:
        """The static arguments' positions and names, each completed from the other as `jax.jit` does."""
        nums, names = jit_options.get("static_argnums"), jit_options.get("static_argnames")
        nums = set() if nums is None else {nums} if isinstance(nums, int) else set(nums)
        names = set() if names is None else {names} if isinstance(names, str) else set(names)
        if self.signature is not None:
            params = list(self.signature.parameters)
            nums = {n % len(params) if n < 0 else n for n in nums}
            names |= {params[n] for n in nums if n < len(params)}
            nums |= {params.index(n) for n in names if n in params}
        return nums, names

    def _key(self, args: tuple, kwargs: dict):
        """What a new compile depends on: the static arguments' values, the others' pytree
        structure and each leaf's shape and dtype (a Python scalar by its type); None while
        another program is traced (a leaf is a tracer)."""
        static = tuple((i, a) for i, a in enumerate(args) if i in self.static_nums)
        static += tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_names))
        traced = ([a for i, a in enumerate(args) if i not in self.static_nums],
                  {k: v for k, v in kwargs.items() if k not in self.static_names})
        leaves, treedef = jax.tree.flatten(traced)
        if any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
            return None
        shapes = tuple((tuple(leaf.shape), str(leaf.dtype), getattr(leaf, "weak_type", False))
                       if hasattr(leaf, "shape") else type(leaf) for leaf in leaves)
        key = (static, treedef, shapes)
        try:
            hash(key)
        except TypeError:  # (a static value or pytree metadata that cannot be hashed: compared as text)
            key = repr(key)
        return key

    def _arguments(self, args: tuple, kwargs: dict) -> dict[str, str]:
        """Each argument (defaults included) by its name, `describe`d."""
        if self.signature is None:
            return {**{str(i): describe(a) for i, a in enumerate(args)}, **{k: describe(v) for k, v in kwargs.items()}}
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return {name: describe(value) for name, value in bound.arguments.items()}

    def _export(self, args: tuple, kwargs: dict) -> None:
        """Exports the program for each platform at a signature it has not been called or lowered
        with yet, and marks its record called in the path running now."""
        key = self._key(args, kwargs)
        if key is not None:
            with _lock:
                record = self.seen.get(key)
                if record is None:
                    record = self.seen[key] = {"program": self.name, "paths": [], "args": self._arguments(args, kwargs),
                                               "platforms": [], "error": None, "seconds": 0.0}
                    new = True
                else:
                    new = False
                _called[id(record)] = record
            if new:  # exported first: a donated argument is deleted by the call
                began = time.perf_counter()
                for platform in PLATFORMS:  # (one at a time: a program lowers each platform's branch alone)
                    try:
                        exported = jax.export.export(self.jitted, platforms=[platform],
                                                     disabled_checks=disabled_checks())(*args, **kwargs)
                        record["platforms"] += list(exported.platforms)
                    except Exception as error:  # noqa: BLE001 (each failure is recorded, and the paths go on)
                        why = "".join(traceback.format_exception_only(error)).strip()[-2000:]
                        record["error"] = (record["error"] or "") + f"{platform}: {why}\n"
                record["seconds"] = round(time.perf_counter() - began, 3)
                with _lock:
                    RECORDS.append(record)

    def __call__(self, *args, **kwargs):
        self._export(args, kwargs)
        return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs):
        """`jax.jit`'s `lower`, the signature exported too: a program compiled ahead of its first
        call (`training.state.CompiledAhead`, from `jax.ShapeDtypeStruct`s) is exported there."""
        self._export(args, kwargs)
        return self.jitted.lower(*args, **kwargs)

    def __get__(self, instance, owner=None):
        """As a method (a jitted function in a class body), bound to its instance."""
        return self if instance is None else functools.partial(self, instance)

    def __getattr__(self, name: str):
        return getattr(self.jitted, name)  # `trace`, `eval_shape`, ... of the program itself


def exporting_jit(fun=None, /, **jit_options):
    """`jax.jit`, exporting the programs made in `jaxformer` and `train` (`ExportingJit`)."""
    if fun is None:  # `jax.jit(static_argnames=...)` as a decorator
        return functools.partial(exporting_jit, **jit_options)
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.split(".")[0] not in ("jaxformer", "train"):
        return REAL_JIT(fun, **jit_options)
    return ExportingJit(fun, jit_options)


def label(what: str) -> None:
    """Adds the path that just ran, `what`, to the `paths` of each record called since the last one."""
    with _lock:
        for record in _called.values():
            record["paths"].append(what)
        _called.clear()


def main(root: Path) -> None:
    jax.jit = exporting_jit  # before the modules that jit at import are imported
    import every_program  # noqa: PLC0415

    from jaxformer import Decoder  # noqa: PLC0415
    from jaxformer.convert import load_hf  # noqa: PLC0415
    from jaxformer.serving.engine import Engine  # noqa: PLC0415

    checked = every_program.ran

    def ran(done, what: str) -> None:
        checked(done, what)
        label(what)

    every_program.ran = ran
    every_program.main(root)
    label("draft model and serving engine")
    # `every_program`'s one request never prefills beside a running step: the engine's warmup
    # runs each of its programs, the fused prefill and step too.
    config, params = load_hf(str(root / "checkpoint"), max_seq_len=64)
    engine = Engine(Decoder(config), params, max_batch=2, capacity=64, prefill_chunk=4)
    try:
        engine.warmup()
    finally:
        engine.close()
    label("serving engine's warmup")
    (root / "exports.json").write_text(json.dumps(RECORDS, indent=1))
    print(f"{len({r['program'] for r in RECORDS})} programs, {len(RECORDS)} exports "
          f"({sum(r['seconds'] for r in RECORDS):.1f} s), {sum(r['error'] is not None for r in RECORDS)} failed")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
