# SPDX-License-Identifier: Apache-2.0
# Copyright 2026 The optax_accum Authors.
"""Data flow in optimized HLO text: instructions, operands, users, fusions.

`parse` reads the text of ``jax.jit(f).lower(...).compile().as_text()`` into
computations of instructions that know their operands and users.
`loop_all_reduces` follows each all-reduce in a while body to the loop's carry
and says whether it has the shape XLA's ``WhileLoopAllReduceCodeMotion`` pass
(run by the GPU and TPU pipelines, not the CPU one) needs to sink it out of the
loop: ``c = all-reduce(b); a += c`` with ``a`` a loop-carried buffer read
nowhere else in the body.

The CPU module is read after fusion, layout assignment and the all-reduce
combiner, later than the pass runs on an accelerator; the walk undoes those:
it enters the fusions that consume a value (fusion operand ``p`` is the fused
computation's ``parameter(p)``) and leaves them through their root, treats
each element of a combined (tuple) all-reduce as an all-reduce of its own, and
accepts ``copy``, which layout assignment inserts to materialize a transpose.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

# Ops the pass lets stand between the all-reduce and the accumulating add
# (plus `copy`, see above). `select` needs a zero on the other side.
FORWARDING = frozenset(
    {"convert", "bitcast", "reshape", "transpose", "copy", "all-reduce-done"}
)
# Ops allowed between the loop parameter and the add's buffer operand, and
# between the add and the root tuple.
BUFFER_FORWARDING = frozenset({"convert", "bitcast", "reshape", "transpose", "copy"})

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_NAME = re.compile(r"%([\w.\-]+)")
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclasses.dataclass
class Instruction:
    """One HLO instruction.

    Attributes:
      name: its name, without the ``%``.
      shape: its result shape, as printed (a tuple shape keeps its parens).
      opcode: e.g. ``"add"``, ``"fusion"``, ``"get-tuple-element"``.
      operands: the names of its operands, in order.
      attrs: the text after the operand list (attributes and metadata).
      computation: the name of the computation that holds it.
      literal: the text inside the parens of a ``constant`` or ``parameter``.
      users: the instructions of the same computation that use it, in order.
    """

    name: str
    shape: str
    opcode: str
    operands: list[str]
    attrs: str
    computation: str
    literal: str = ""
    users: list[str] = dataclasses.field(default_factory=list)

    @property
    def index(self) -> int | None:
        """The tuple index of a ``get-tuple-element``."""
        m = re.search(r"\bindex=(\d+)", self.attrs)
        return int(m.group(1)) if m and self.opcode == "get-tuple-element" else None

    @property
    def parameter_number(self) -> int | None:
        return int(self.literal) if self.opcode == "parameter" else None

    def called(self, key: str) -> str | None:
        """The computation named by attribute ``key`` (``calls``, ``body``...)."""
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return m.group(1) if m else None

    @property
    def element_shapes(self) -> list[str]:
        """The shapes of a tuple result's elements, or ``[shape]``."""
        return tuple_elements(self.shape)

    @property
    def is_tuple(self) -> bool:
        return self.shape.startswith("(")


@dataclasses.dataclass
class Computation:
    """A computation: instructions by name, in order, and its root."""

    name: str
    instructions: dict[str, Instruction]
    root: str

    def parameter(self, number: int) -> Instruction:
        for instr in self.instructions.values():
            if instr.parameter_number == number:
                return instr
        raise KeyError(f"{self.name} has no parameter({number})")

    def __getitem__(self, name: str) -> Instruction:
        return self.instructions[name]


@dataclasses.dataclass
class Module:
    """A parsed HLO module."""

    computations: dict[str, Computation]
    entry: str | None

    def whiles(self) -> Iterator[tuple[Computation, Instruction]]:
        """Every while instruction, with the computation that holds it."""
        for comp in self.computations.values():
            for instr in comp.instructions.values():
                if instr.opcode == "while":
                    yield comp, instr

    def body(self, loop: Instruction) -> Computation:
        return self.computations[loop.called("body")]

    def condition(self, loop: Instruction) -> Computation:
        return self.computations[loop.called("condition")]

    def fused(self, fusion: Instruction) -> Computation:
        return self.computations[fusion.called("calls")]


def _balanced(text: str, start: int) -> int:
    """The index just past the paren group that opens at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError(f"unbalanced parens in {text!r}")


def tuple_elements(shape: str) -> list[str]:
    """Top-level element shapes of a tuple shape string, or ``[shape]``."""
    if not shape.startswith("("):
        return [shape]
    inner = _COMMENT.sub("", shape[1:-1])
    out, depth, cur = [], 0, ""
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def is_scalar(shape: str) -> bool:
    """Whether an array shape string has rank 0 (``f32[]``)."""
    return bool(re.match(r"^\w+\[\]", shape))


def _instruction(line: str, computation: str) -> tuple[Instruction, bool] | None:
    m = _INSTR.match(line)
    if not m:
        return None
    is_root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    paren = rest.index("(")
    opcode = rest[:paren].strip()
    end = _balanced(rest, paren)
    inside, attrs = rest[paren + 1 : end - 1], rest[end:].lstrip(", ")
    literal = inside if opcode in ("constant", "parameter") else ""
    operands = [] if literal else _NAME.findall(_COMMENT.sub("", inside))
    instr = Instruction(name, shape, opcode, operands, attrs, computation, literal)
    return instr, is_root


def parse(hlo: str) -> Module:
    """Parses HLO module text into computations of linked instructions."""
    comps: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    for raw in hlo.splitlines():
        line = raw.strip()
        header = _HEADER.match(line)
        if header and current is None:
            current = Computation(header.group(2), {}, "")
            comps[current.name] = current
            if header.group(1):
                entry = current.name
        elif line == "}":
            current = None
        elif current is not None and line:
            parsed = _instruction(line, current.name)
            if parsed is None:
                continue
            instr, is_root = parsed
            current.instructions[instr.name] = instr
            if is_root:
                current.root = instr.name
    for comp in comps.values():
        for instr in comp.instructions.values():
            for op in instr.operands:
                if op in comp.instructions:
                    users = comp.instructions[op].users
                    if instr.name not in users:
                        users.append(instr.name)
    return Module(comps, entry)


# --- Following an all-reduce to the carry ------------------------------------


@dataclasses.dataclass(frozen=True)
class _Value:
    """A value: instruction ``name`` of ``comp``, element ``element`` of a
    tuple (``None`` for the whole result), inside the fusions of ``stack``
    (the fusion instructions entered, outermost first, with their computation).
    """

    comp: str
    name: str
    element: int | None
    stack: tuple[tuple[str, str], ...]


@dataclasses.dataclass
class Path:
    """One way an all-reduce's result reaches something.

    Attributes:
      ops: the ops met on the way, in order (fusions are walked through, so
        their fused ops appear, not ``fusion``).
      ok: whether this way is one the pass accepts.
      reason: why not, when ``ok`` is false.
      carry_index: the loop tuple index it reaches, when ``ok``.
      add: the accumulating add, ``(computation, name)``, when ``ok``.
    """

    ops: list[str]
    ok: bool
    reason: str = ""
    carry_index: int | None = None
    add: tuple[str, str] | None = None


@dataclasses.dataclass
class LoopAllReduce:
    """One non-scalar all-reduce (or one element of a combined one) in a loop.

    Attributes:
      loop: the while instruction's name.
      name: the all-reduce instruction's name.
      element: its tuple element, for a combined all-reduce, else ``None``.
      shape: the reduced array's shape.
      paths: every way its result is used, followed to its end.
      buffer_reads: reads of an accumulator other than by its add, as
        ``"index i: ops"`` strings.
    """

    loop: str
    name: str
    element: int | None
    shape: str
    paths: list[Path]
    buffer_reads: list[str]

    @property
    def movable(self) -> bool:
        """Whether the pass would sink it out of the loop."""
        return (
            bool(self.paths)
            and all(p.ok for p in self.paths)
            and not (self.buffer_reads)
        )

    def describe(self) -> str:
        where = self.name if self.element is None else f"{self.name}[{self.element}]"
        lines = [f"{where} {self.shape}: {'movable' if self.movable else 'stays'}"]
        for p in self.paths:
            tail = f"-> carry[{p.carry_index}]" if p.ok else f"REJECTED ({p.reason})"
            lines.append(f"  {', '.join(p.ops) or '(nothing)'} {tail}")
        lines += [f"  accumulator read elsewhere: {r}" for r in self.buffer_reads]
        return "\n".join(lines)


class _Walker:
    """Walks values through one while body and the fusions it calls."""

    def __init__(self, module: Module, body: Computation, scaled: bool = False):
        self.module = module
        self.body = body
        self.scaled = scaled

    def _reduced_scalar(self, comp: str, name: str, stack) -> bool:
        """Whether a multiply's other operand is a broadcast scalar all-reduce."""
        broadcast = False
        while True:
            instr = self.module.computations[comp][name]
            if instr.opcode == "parameter" and stack:
                outer_comp, fusion = stack[-1]
                fusion_instr = self.module.computations[outer_comp][fusion]
                comp, name = outer_comp, fusion_instr.operands[instr.parameter_number]
                stack = stack[:-1]
            elif instr.opcode in ("broadcast", "convert"):
                broadcast |= instr.opcode == "broadcast"
                name = instr.operands[0]
            elif instr.opcode == "get-tuple-element":
                src = self.module.computations[comp][instr.operands[0]]
                return (
                    broadcast
                    and src.opcode in ("all-reduce", "all-reduce-done")
                    and is_scalar(instr.shape)
                )
            else:
                return (
                    broadcast
                    and instr.opcode in ("all-reduce", "all-reduce-done")
                    and is_scalar(instr.shape)
                )

    def instr(self, v: _Value) -> Instruction:
        return self.module.computations[v.comp][v.name]

    def _is_zero(self, comp: str, name: str, stack) -> bool:
        """A zero constant, or a broadcast (or fusion parameter) of one."""
        instr = self.module.computations[comp][name]
        if instr.opcode == "constant":
            return bool(re.fullmatch(r"-?0(\.0*)?(e[+-]?\d+)?", instr.literal.strip()))
        if instr.opcode in ("broadcast", "copy", "convert", "bitcast"):
            return self._is_zero(comp, instr.operands[0], stack)
        if instr.opcode == "parameter" and stack:
            outer_comp, fusion = stack[-1]
            fusion_instr = self.module.computations[outer_comp][fusion]
            outer = fusion_instr.operands[instr.parameter_number]
            return self._is_zero(outer_comp, outer, stack[:-1])
        return False

    def users(self, v: _Value) -> Iterator[tuple[_Value, Instruction, int]]:
        """Users of ``v``, with the operand position ``v`` takes in each.

        Enters fusions (yielding the fused parameter's users) and leaves them
        at their root (yielding the fusion's users in the outer computation).
        """
        comp = self.module.computations[v.comp]
        if v.name == comp.root and v.stack:
            # The fused root: leave the fusion.
            outer_comp, fusion = v.stack[-1]
            out = _Value(outer_comp, fusion, v.element, v.stack[:-1])
            yield from self.users(out)
            return
        me = comp[v.name]
        for uname in me.users:
            user = comp[uname]
            positions = [i for i, op in enumerate(user.operands) if op == v.name]
            if (
                user.opcode == "get-tuple-element"
                and v.element is not None
                and user.index != v.element
            ):
                continue  # another element of the same tuple
            for pos in positions:
                if user.opcode == "tuple" and v.stack and uname == comp.root:
                    # An output of a multi-output fusion: its element ``pos``.
                    outer_comp, fusion = v.stack[-1]
                    out = _Value(outer_comp, fusion, pos, v.stack[:-1])
                    yield from self.users(out)
                elif user.opcode == "fusion":
                    fused = self.module.fused(user)
                    param = fused.parameter(pos)
                    inner = _Value(
                        fused.name,
                        param.name,
                        v.element,
                        (*v.stack, (v.comp, user.name)),
                    )
                    yield from self.users(inner)
                else:
                    yield _Value(v.comp, v.name, v.element, v.stack), user, pos

    def origin(self, comp: str, name: str, stack) -> tuple[int | None, list[str]]:
        """Follows a buffer operand back to ``get-tuple-element(param, i)``.

        Returns ``(i, ops)``, or ``(None, ops)`` where the buffer does not come
        from the loop parameter through forwarding ops alone.
        """
        ops: list[str] = []
        while True:
            instr = self.module.computations[comp][name]
            if instr.opcode == "parameter" and stack:
                outer_comp, fusion = stack[-1]
                fusion_instr = self.module.computations[outer_comp][fusion]
                comp, name = outer_comp, fusion_instr.operands[instr.parameter_number]
                stack = stack[:-1]
                continue
            if instr.opcode in BUFFER_FORWARDING:
                ops.append(instr.opcode)
                name = instr.operands[0]
                continue
            if instr.opcode == "get-tuple-element" and not stack:
                src = self.module.computations[comp][instr.operands[0]]
                if comp == self.body.name and src.opcode == "parameter":
                    return instr.index, ops
            return None, [*ops, instr.opcode]

    def to_root(self, v: _Value) -> tuple[int | None, str]:
        """Follows an add's result through forwarding ops to the root tuple.

        Returns ``(i, "")`` for ``carry[i]``, or ``(None, why not)``.
        """
        index = None
        for here, user, pos in self.users(v):
            nxt = _Value(user.computation, user.name, None, here.stack)
            if user.opcode in BUFFER_FORWARDING or user.opcode == "get-tuple-element":
                got, why = self.to_root(nxt)
            elif self._is_body_root(user, here.stack):
                got, why = pos, ""
            else:
                return None, f"the sum is used by {user.opcode}"
            if got is None:
                return None, why
            if index is not None and got != index:
                return None, "the sum reaches several carry indices"
            index = got
        if index is None:
            return None, "the sum never reaches the loop's carry"
        return index, ""

    def _is_body_root(self, user: Instruction, stack) -> bool:
        return (
            not stack
            and user.computation == self.body.name
            and user.name == self.body.root
        )

    def follow(self, v: _Value, ops: list[str], out: list[Path]) -> None:
        """Appends to ``out`` every path from ``v`` to its end."""
        any_user = False
        for here, user, pos in self.users(v):
            any_user = True
            op = user.opcode
            nxt = _Value(user.computation, user.name, None, here.stack)
            if op == "get-tuple-element":
                self.follow(nxt, ops, out)
            elif op in FORWARDING:
                self.follow(nxt, [*ops, op], out)
            elif op == "select":
                other = user.operands[2 if pos == 1 else 1]
                if pos in (1, 2) and self._is_zero(user.computation, other, here.stack):
                    self.follow(nxt, [*ops, "select"], out)
                else:
                    out.append(Path([*ops, op], False, "select without a zero"))
            elif (
                op == "multiply"
                and self.scaled
                and self._reduced_scalar(
                    user.computation, user.operands[1 - pos], here.stack
                )
            ):
                self.follow(nxt, [*ops, "multiply"], out)
            elif op == "add":
                buffer = user.operands[1 - pos]
                src, buf_ops = self.origin(user.computation, buffer, here.stack)
                if src is None:
                    why = f"the add's other operand is {', '.join(buf_ops)}"
                    out.append(Path([*ops, op], False, why))
                    continue
                dst, why = self.to_root(nxt)
                if dst is None:
                    out.append(Path([*ops, op], False, why))
                elif dst != src:
                    why = f"adds carry[{src}] but writes carry[{dst}]"
                    out.append(Path([*ops, op], False, why))
                else:
                    add = (user.computation, user.name)
                    out.append(Path([*ops, op], True, carry_index=dst, add=add))
            elif self._is_body_root(user, here.stack):
                out.append(Path(ops, False, f"stored in carry[{pos}] without an add"))
            else:
                out.append(Path([*ops, op], False, f"used by {op}"))
        if not any_user:
            out.append(Path(ops, False, "unused"))

    def buffer_reads(self, index: int, adds: set[tuple[str, str]]) -> list[str]:
        """Uses of ``carry[index]`` in the body other than the accepted adds."""
        reads: list[str] = []
        param = self.body.parameter(0)
        for uname in param.users:
            gte = self.body[uname]
            if gte.opcode != "get-tuple-element":
                reads.append(f"index {index}: the parameter is used by {gte.opcode}")
            elif gte.index == index:
                self._reads(_Value(self.body.name, gte.name, None, ()), [], adds, reads)
        return [f"index {index}: {r}" for r in reads]

    def _reads(self, v: _Value, ops, adds, reads) -> None:
        for here, user, _ in self.users(v):
            if (user.computation, user.name) in adds:
                continue
            if user.opcode in BUFFER_FORWARDING:
                nxt = _Value(user.computation, user.name, None, here.stack)
                self._reads(nxt, [*ops, user.opcode], adds, reads)
            elif self._is_body_root(user, here.stack):
                reads.append(", ".join([*ops, "tuple"]) + " (passed through)")
            else:
                reads.append(", ".join([*ops, user.opcode]))


def loop_all_reduces(
    module: Module, include_scalars: bool = False, scaled: bool = False
):
    """Every all-reduce in every while body, followed to its ends.

    A combined (tuple-shaped) all-reduce gives one `LoopAllReduce` per
    element; scalar elements (loss values, weight sums) are left out unless
    ``include_scalars``. An all-reduce in a computation the body calls other
    than through a fusion (a conditional branch) is reported as not movable.

    The rules are the pass's long-standing ones, read conservatively: only
    convert, bitcast, reshape, transpose (and copy), and a select against
    zero, stand between the all-reduce and the add; a dynamic-slice/update
    pair on the accumulator is not recognized (rejected), and a select's
    predicate is not checked for being replicated. Recent versions of the
    pass also let ``multiply(all-reduce(g), broadcast(s))`` through where
    ``s`` is a scalar all-reduce (a weight reduced in the loop);
    ``scaled=True`` accepts that too.

    Returns:
      A list of `LoopAllReduce`.
    """
    found: list[LoopAllReduce] = []
    for _, loop in module.whiles():
        body = module.body(loop)
        walker = _Walker(module, body, scaled)
        for instr in body.instructions.values():
            if instr.opcode not in ("all-reduce", "all-reduce-start"):
                continue
            elements = (
                list(enumerate(instr.element_shapes))
                if instr.is_tuple
                else [(None, instr.shape)]
            )
            for element, shape in elements:
                if is_scalar(shape) and not include_scalars:
                    continue
                paths: list[Path] = []
                start = _Value(body.name, instr.name, element, ())
                walker.follow(start, [], paths)
                adds = {p.add for p in paths if p.ok}
                reads = []
                for index in sorted({p.carry_index for p in paths if p.ok}):
                    reads += walker.buffer_reads(index, adds)
                found.append(
                    LoopAllReduce(loop.name, instr.name, element, shape, paths, reads)
                )
        found += _nested_all_reduces(module, loop, include_scalars)
    return found


def _nested_all_reduces(module: Module, loop: Instruction, include_scalars: bool):
    """All-reduces the body reaches through calls other than fusions."""
    body = module.body(loop)
    seen, todo, out = {body.name}, [], []
    for instr in body.instructions.values():
        if instr.opcode in ("conditional", "call"):
            todo += re.findall(r"%([\w.\-]+)", instr.attrs)
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        for instr in module.computations[name].instructions.values():
            if instr.opcode in ("all-reduce", "all-reduce-start"):
                for element, shape in enumerate(instr.element_shapes):
                    if include_scalars or not is_scalar(shape):
                        why = f"inside {name}, called from the loop body"
                        el = element if instr.is_tuple else None
                        out.append(
                            LoopAllReduce(
                                loop.name,
                                instr.name,
                                el,
                                shape,
                                [Path([], False, why)],
                                [],
                            )
                        )
            if instr.opcode in ("conditional", "call"):
                todo += re.findall(r"%([\w.\-]+)", instr.attrs)
    return out


def all_reduces_outside_loops(module: Module, include_scalars: bool = False):
    """All-reduces (or elements) of the entry computation: ``(name, shape)``."""
    out = []
    entry = module.computations[module.entry]
    for instr in entry.instructions.values():
        if instr.opcode in ("all-reduce", "all-reduce-start"):
            for shape in instr.element_shapes:
                if include_scalars or not is_scalar(shape):
                    out.append((instr.name, shape))
    return out
