"""Jinja templates that run within bounds of time and size, every failure one line.

Jinja's sandbox keeps a template from Python's internals, not from the machine's time and
memory (`{{ "x" * 10**9 }}`, nested loops over `range(100000)`). `BoundedEnvironment` is
the `ImmutableSandboxedEnvironment` transformers renders with, plus the bounds tabled in
docs/text.md ("Chat templates"): time by a per-thread trace function (`bounds`), and the
size of each step and of all of them.

Where Jinja 3.1 compiles what, and so where each bound hooks in: `+ * ** %` go through
`call_binop` (`intercepted_binops`); calls `f(...)`, `s.center(...)` through `call`;
filters are called directly, so each is wrapped; `a ~ b` is joined by the compiled code
itself, so the compiler here sends it through `concat_text`; the output of the template
and of its blocks is joined by `Environment.concat`.
"""

from __future__ import annotations

import contextlib
import functools
import re
import string
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, Callable

from jinja2 import pass_eval_context
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

# Far above what real templates take (docs/text.md, "Chat templates"): room for a busy machine.
RENDER_SECONDS = 10.0
MAX_TEMPLATE_CHARS = 2**16  # a template's length (real ones: up to about 20,000), which bounds its compile time
MAX_SIZE = 4 * 2**20  # characters of the text, or of any string (items of any list) one step builds
MAX_BUILT = 16 * MAX_SIZE  # characters (or items) of all the values one rendering builds
MAX_INT_BITS = 2**16  # about 20,000 digits; Python prints at most 4,300
TEMPLATE_FILE = "<template>"  # the file name of a template's compiled code (`Environment.from_string`)

# `%`-format fields: `%(key)-08.3f`, `%*d`, `%s`: the width and the precision.
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_budget = threading.local()  # `left`: what the rendering running in this thread may still build
_TEXT = (str, bytes, bytearray)
_SIZED = (str, bytes, bytearray, list, tuple, dict, set, frozenset)
# Filters that look at a container's items, never turn the whole of it into text: their
# input is not measured (`messages | length`, in a loop over the messages, stays cheap).
_ITEM_FILTERS = frozenset({"attr", "batch", "count", "d", "default", "dictsort", "first", "groupby", "items", "last",
                           "length", "list", "map", "max", "min", "random", "reject", "rejectattr", "reverse", "select",
                           "selectattr", "slice", "sort", "unique"})


class TemplateLimitError(BaseException):
    """A template passed a bound (the message says which). A `BaseException`, so that no
    `except Exception` in a filter or in Jinja swallows it: raised from the trace function
    it also turns the trace off, and a swallowed one would leave the template unbounded.
    """


@contextlib.contextmanager
def bounds(seconds: float = RENDER_SECONDS) -> Iterator[None]:
    """Holds what runs in the block, in this thread, to `seconds` and to `MAX_BUILT`, raising
    `TemplateLimitError`: the clock is read at every line of a template's code and every
    Python call. The previous trace function (a debugger's, coverage's) is back afterwards.
    """
    end = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > end:
            raise TemplateLimitError(f"ran past its time limit of {seconds:g} s")
        # Every line of a template's own frames (its loops); other frames at their calls only,
        # which keeps the check to a fraction of a template's time.
        return trace if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous, budget = sys.gettrace(), getattr(_budget, "left", None)
    _budget.left = MAX_BUILT
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
        _budget.left = budget


def size(value: Any, budget: int = MAX_SIZE) -> int:
    """About how many characters `value` becomes as text (a container: its items, plus
    separators), counting no further than `budget`, so a huge or self-containing value
    costs at most `budget` steps."""
    total, pending = 0, [value]
    while pending and total <= budget:
        item = pending.pop()
        total += 1
        if isinstance(item, _TEXT):
            total += len(item)
        elif isinstance(item, int):
            total += item.bit_length() // 3  # at least its decimal digits
        elif isinstance(item, Mapping):
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.extend(item)
        elif isinstance(item, Namespace):  # `namespace(...)`: its attributes (Jinja keeps them private)
            pending.append(object.__getattribute__(item, "_Namespace__attrs"))
    return total


def check_size(n: int) -> None:
    """Raises `TemplateLimitError` if a value of `n` characters (or items) is past `MAX_SIZE`."""
    if n > MAX_SIZE:
        raise TemplateLimitError(f"builds a value of {n:,} characters (or items) in one step, past the limit of "
                                 f"{MAX_SIZE:,}")


def check_bits(n: int) -> None:
    """Raises `TemplateLimitError` if an int of `n` bits is past `MAX_INT_BITS`."""
    if n > MAX_INT_BITS:
        raise TemplateLimitError(f"builds an int of {n:,} bits in one step, past the limit of {MAX_INT_BITS:,}")


def spend(n: int) -> None:
    """Counts `n` characters (or items) against the `MAX_BUILT` of the `bounds` this
    thread runs in (none outside `bounds`); raises `TemplateLimitError` past it."""
    left = getattr(_budget, "left", None)
    if left is None:
        return
    _budget.left = left - n
    if _budget.left < 0:
        raise TemplateLimitError(f"builds more than {MAX_BUILT:,} characters (or items) in all, past its limit")


def built(value: Any) -> Any:
    """`value`, a step's result, once its own length (or bits) is within the limits and
    counted (`spend`): every call, filter and operator's result, cheaply (a length, not
    the items)."""
    if isinstance(value, int):
        check_bits(value.bit_length())
        spend(value.bit_length() // 3)  # about its digits
    elif isinstance(value, _SIZED):
        check_size(len(value))
        spend(len(value))
    return value


def _materialized(value: Any) -> Any:
    """A list of an iterator's items (a generator from `map`, `select`...), so that it can
    be measured and still be read by the call; anything else as it is."""
    return list(value) if isinstance(value, Iterator) else value


def _arg(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """A call's argument, given by position or by name."""
    return args[position] if len(args) > position else kwargs.get(name, default)


def _width(value: Any) -> int:
    """A width or a count as an int (anything else makes the call itself fail)."""
    return value if isinstance(value, int) else 0


# Estimates, before the call, of the size of what a method or a filter returns where it
# can be far larger than its operands: `(value, args, kwargs) -> characters or items`.


def _padded(text, args, kwargs) -> int:
    return max(size(text), _width(_arg(args, kwargs, 0, "width", 80)))


def _replaced(text, old, new, count) -> int:
    """The length of `text.replace(old, new, count)`: each of up to `count` matches grows by `new`."""
    if not (isinstance(text, _TEXT) and type(old) is type(new) is type(text)):
        return size(text)  # the call fails (or the filter converts them, below)
    matches = text.count(old)
    if isinstance(count, int) and count >= 0:
        matches = min(matches, count)
    return len(text) + matches * max(len(new) - len(old), 0)


def _joined(items, separator) -> int:
    """The length of `separator.join(items)`: the items, and a separator between each two."""
    items = list(items) if isinstance(items, (Mapping, range, set, frozenset)) else items
    n = len(items) if hasattr(items, "__len__") else 0
    return size(items) + max(n - 1, 0) * size(separator)


def _percent_formatted(template, values) -> int:
    """The length of `template % values`, from above: the text, each field's width and
    precision (with `*` they come from the values), and each field as long as the longest
    value."""
    if not isinstance(template, _TEXT):
        return 0  # a number's `%`
    if isinstance(template, (bytes, bytearray)):
        template = template.decode("latin-1")
    fields = _PERCENT_FIELD.findall(template)
    values = tuple(values.values()) if isinstance(values, Mapping) else values if isinstance(values, tuple) else (
        values,)
    widths = sum(int(n) for field in fields for n in field if n.isdigit())
    if any("*" in field for field in fields):
        widths += sum(abs(v) for v in values if isinstance(v, int))
    return len(template) + widths + len(fields) * max((size(v) for v in values), default=0)


def _brace_formatted(template: str, args, kwargs) -> int:
    """The length of `template.format(*args, **kwargs)`, from above, as `_percent_formatted`."""
    try:
        specs = [spec or "" for _, name, spec, _ in string.Formatter().parse(template) if name is not None]
    except ValueError:
        return 0  # not a format: the call says so
    values = (*args, *kwargs.values())
    widths = sum(int(n) for spec in specs for n in re.findall(r"\d+", spec))
    if any("{" in spec for spec in specs):  # a width given by an argument: `{:{}}`
        widths += sum(abs(v) for v in values if isinstance(v, int))
    return len(template) + widths + len(specs) * max((size(v) for v in values), default=0)


def _indent_width(indent) -> int:
    """An indent given as a string or as a number of spaces (`indent`, `tojson`)."""
    return len(indent) if isinstance(indent, str) else _width(indent)


def _indented(text, args, kwargs) -> int:
    """The `indent` filter: every line (with `first` and `blank`, at most all) gains the indent."""
    lines = text.count("\n") + 1 if isinstance(text, str) else size(text) + 1
    return size(text) + lines * _indent_width(_arg(args, kwargs, 0, "width", 4))


def _translated(text, args, kwargs) -> int:
    """`str.translate`: every character may become the longest string of the table."""
    table = _arg(args, kwargs, 0, "table")
    return len(text) * max([1, *map(size, table.values())]) if isinstance(table, Mapping) else len(text)


def _mapping(value) -> dict:
    """`format_map`'s argument as keyword arguments (anything else makes the call fail)."""
    return dict(value) if isinstance(value, Mapping) else {}


def _tab(text) -> str | bytes:
    return "\t" if isinstance(text, str) else b"\t"


TEXT_METHOD_SIZES: dict[str, Callable[[Any, tuple, dict], int]] = {
    "center": _padded, "ljust": _padded, "rjust": _padded, "zfill": _padded,
    "expandtabs": lambda s, a, k: len(s) + s.count(_tab(s)) * _width(_arg(a, k, 0, "tabsize", 8)),
    "replace": lambda s, a, k: _replaced(s, _arg(a, k, 0, "old"), _arg(a, k, 1, "new"), _arg(a, k, 2, "count", -1)),
    "join": lambda s, a, k: _joined(_arg(a, k, 0, "iterable", ()), s),
    "translate": _translated,
    "format": _brace_formatted,
    "format_map": lambda s, a, k: _brace_formatted(s, (), _mapping(_arg(a, k, 0, "mapping"))),
}
FILTER_SIZES: dict[str, Callable[[Any, tuple, dict], int]] = {
    "center": _padded,
    "indent": _indented,
    "join": lambda v, a, k: _joined(v, _arg(a, k, 0, "d", "")),
    "replace": lambda v, a, k: _replaced(str(v), str(_arg(a, k, 0, "old", "")), str(_arg(a, k, 1, "new", "")),
                                         _arg(a, k, 2, "count")),
    "format": lambda v, a, k: _percent_formatted(v, a or k),
    "wordwrap": lambda v, a, k: size(v) * (1 + len(str(_arg(a, k, 2, "wrapstring") or "\n"))),  # a break a character
    "tojson": lambda v, a, k: size(v) * (6 + _indent_width(_arg(a, k, 1, "indent"))),  # "\u0000" is six characters
    "batch": lambda v, a, k: size(v) + _width(_arg(a, k, 0, "linecount")),
    "slice": lambda v, a, k: size(v) + _width(_arg(a, k, 0, "slices")),  # `slices` lists, empty ones too
}


def _call_size(target: Callable, args: tuple, kwargs: dict) -> int | None:
    """The estimated size of what calling `target` returns, for the methods that repeat."""
    method = getattr(target, "__wrapped__", target)  # the sandbox wraps str.format in a function of its own
    receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if isinstance(receiver, _TEXT) and name in TEXT_METHOD_SIZES:
        return TEXT_METHOD_SIZES[name](receiver, args, kwargs)
    if isinstance(receiver, int) and name == "to_bytes":
        return _width(_arg(args, kwargs, 0, "length", 1))
    return None


def bounded_filter(name: str, f: Callable) -> Callable:
    """The filter `f`, measured: its input if it turns it into text, what it will make
    where that can be far larger (`FILTER_SIZES`), and what it returns."""
    takes_context = getattr(f, "jinja_pass_arg", None) is not None  # (context, value, ...)

    @functools.wraps(f)  # keeps `jinja_pass_arg`: Jinja passes the same first argument
    def bounded(*args, **kwargs):
        args = tuple(map(_materialized, args))
        value, *rest = args[takes_context:]
        if name not in _ITEM_FILTERS:
            check_size(size(value) + sum(size(v) for v in (*rest, *kwargs.values())))
        if name in FILTER_SIZES:
            check_size(FILTER_SIZES[name](value, tuple(rest), kwargs))
        return built(f(*args, **kwargs))

    return bounded


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's compiler, but `a ~ b ~ c` becomes `environment.concat_text((a, b, c))`: the
    compiled code would join the parts itself, out of reach of `call_binop`."""

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat_text((")
        for part in node.nodes:
            self.visit(part, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with the size bounds of this module on every step.

    Render within `bounds()` for the bounds of time and of all steps together. Nothing
    of the template runs while it compiles, outside `bounds`: Jinja's optimiser, which
    would evaluate constant expressions then, is off, and so is its printing of constant
    `{{ }}` (the text is the same), so a template's compile time follows from its length
    (`MAX_TEMPLATE_CHARS`). Autoescaping is off (as in transformers); the parts of `~`
    are joined as text.

    Args:
      filters: filters to add to Jinja's own (`tojson`, say); all of them are bounded.
      **options: `Environment`'s options (`trim_blocks`, `extensions`...).
    """

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *, filters: dict[str, Callable] | None = None, **options):
        super().__init__(finalize=self.measured_output, optimized=False, **options)
        self.filters.update(filters or {})
        self.filters = {name: bounded_filter(name, f) for name, f in self.filters.items()}

    @staticmethod
    @pass_eval_context  # a finalize that needs the context keeps Jinja from printing constants while compiling
    def measured_output(eval_context, value: Any) -> Any:
        """`{{ value }}`: refused if it would print more than `MAX_SIZE` characters."""
        if not isinstance(value, str):  # (a string is printed as it is, nothing new is built)
            printed = size(value)
            check_size(printed)
            spend(printed)
        return value

    @staticmethod
    def concat(pieces) -> str:
        """Joins the output of the template, and of each block (a macro's body, `{% set %}`,
        `{% filter %}`), refused once it passes `MAX_SIZE` characters."""
        kept, length = [], 0
        for piece in pieces:
            length += len(piece)
            if length > MAX_SIZE:
                raise TemplateLimitError(f"renders more than {MAX_SIZE:,} characters, past its limit")
            kept.append(piece)
        spend(length)
        return "".join(kept)

    @staticmethod
    def concat_text(parts: tuple) -> str:
        """`a ~ b ~ ...`: the parts as text, joined once their sizes are within the limit."""
        check_size(sum(size(part) for part in parts))
        return built("".join(map(str, parts)))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        """`+ * ** %`, each refused before it runs if its result would pass a limit."""
        if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            check_bits(right * (abs(left).bit_length() - 1) + 1)  # at least |left| ** right's bits
        elif operator == "*" and isinstance(left, int) and isinstance(right, int):
            check_bits(left.bit_length() + right.bit_length())
        elif operator == "*" and isinstance(left, int) != isinstance(right, int):  # a sequence repeated
            times, sequence = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(sequence, _SIZED):
                check_size(len(sequence) * times)
        elif operator == "+" and isinstance(left, _SIZED) and isinstance(right, _SIZED):
            check_size(len(left) + len(right))
        elif operator == "%":
            check_size(_percent_formatted(left, right))
        return built(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # Jinja's names: they cannot clash with a call's kwargs
        """A call from the template: refused before it runs if a method that repeats
        (`TEXT_METHOD_SIZES`) would pass the limit; what it returns is `built`."""
        args = tuple(map(_materialized, args))
        kwargs = {key: _materialized(value) for key, value in kwargs.items()}
        estimate = _call_size(__obj, args, kwargs)
        if estimate is not None:
            check_size(estimate)
        return built(super().call(__context, __obj, *args, **kwargs))
