"""The one module that reads XLA's dump files: a compile that writes them, and their parse into buffers over time.

XLA's dump format is not a public API, so everything that reads it is fenced here (as
:mod:`remat_kit._jax_internals` fences private JAX), and ``tests/test_xla_dump.py`` checks it on every JAX
CI runs: a format change breaks this one place, loudly (:class:`DumpFormatError`), never a silent zero.

:func:`compile_with_dump` compiles a ``Lowered`` with ``xla_dump_to`` set (compile-only, nothing runs) and
parses three files XLA writes for the optimized module (the same names on jax 0.10.2 and 0.12):

* ``*after_optimizations.txt``: the scheduled HLO; each instruction's computation, opcode and
  ``metadata={op_name=... stack_frame_id=...}`` (or ``source_file=/source_line=``), and each
  ``while``'s ``known_trip_count``;
* ``*after_optimizations-buffer-assignment.txt``: every allocation (size, kind: parameter N /
  maybe-live-out / preallocated-temp / constant / thread-local, colour = memory space) and the HLO values
  it holds (size, offset, shape);
* ``*after_optimizations-live-range.txt``: the flattened instruction sequence (a while body's
  instructions appear once, just before the ``while``) and each value's live range over it, inclusive.

>>> import jax, jax.numpy as jnp
>>> lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(jax.ShapeDtypeStruct((256,), jnp.float32))
>>> compiled, program = compile_with_dump(lowered)
>>> max(program.live_bytes()) <= 2 * 1024 + 64  # the input and the output, live together
True
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import tempfile
from collections.abc import Sequence

#: The memory space XLA gives host memory (``S(5)`` in HLO layouts); colour 0 is the device.
HOST_COLOR = 5

#: Bytes per element of the HLO dtypes a buffer may carry.
_DTYPE_BYTES = {
    "pred": 1,
    "s4": 1,
    "u4": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

#: Opcodes that only move, cast or re-lay out their one operand: a buffer they make holds another value's data.
MOVES = ("convert", "copy", "bitcast", "transpose", "reshape")

#: Allocation kinds :meth:`jax.stages.Compiled.memory_analysis` counts (constants and thread-local scratch it does not).
COUNTED_KINDS = ("parameter", "output", "temp")


class DumpFormatError(RuntimeError):
    """XLA's dump files are missing or no longer in the format this module reads."""


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of the optimized, scheduled HLO.

    Attributes:
      name: its HLO name; computation: the computation it sits in; opcode: its opcode.
      op_name: JAX's ``op_name`` metadata (``"jit(f)/transpose(jvp())/dot_general"``), "" if none.
      source: ``"file.py:12 (function)"`` from its stack frame or source metadata, "" if none.
      parameter: the entry parameter number for an entry ``parameter(N)``, else None.
      operands: the names it reads, in order (an elided tuple element as ``"while.3#2"``).
      index: a ``get-tuple-element``'s index, else None.
      moves: the data-movement ops it applies to its one operand (:data:`MOVES`: ``("convert",)`` for a
        ``convert`` or a fusion of nothing but one), () for an instruction that computes.
      dtype, shape: its result's HLO dtype and shape ("" and () for a tuple).
      root: it is its computation's ROOT.
      calls: the computation it calls (a fusion's fused computation, a call's), "" if none.
    """

    name: str
    computation: str
    opcode: str
    op_name: str
    source: str
    parameter: int | None = None
    operands: tuple[str, ...] = ()
    index: int | None = None
    moves: tuple[str, ...] = ()
    dtype: str = ""
    shape: tuple[int, ...] = ()
    root: bool = False
    calls: str = ""


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One HLO value with its place in memory and its live range.

    Attributes:
      name: the value (``"dot.4"``, ``"while.3{2}"``); instruction: the instruction that defines it.
      shape, dtype, nbytes: as assigned (``dtype`` ``"tuple"`` for a tuple's pointer table).
      allocation, offset: where it lives; kind: ``"parameter"``, ``"output"``, ``"temp"``, ``"constant"``
        or ``"thread-local"``; color: the memory space (:data:`HOST_COLOR` for host memory).
      parameter: the entry parameter number its allocation holds, else None.
      phi: True for a loop-carried alias of another value (same bytes, counted once).
      start, end: its live range over :attr:`Program.sequence`, both inclusive (-1, -1 when XLA lists none).
    """

    name: str
    instruction: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    allocation: int
    offset: int
    kind: str
    color: int
    parameter: int | None
    phi: bool
    start: int
    end: int

    @property
    def host(self) -> bool:
        """Whether XLA placed it in host memory."""
        return self.color == HOST_COLOR


@dataclasses.dataclass(frozen=True)
class Origin:
    """The value a chain of data-movement instructions (:data:`MOVES`) reads, from :meth:`Program.origin`.

    Attributes:
      value: the value read, as the buffer assignment names it (``"while.3{2}"`` for a tuple element).
      instruction: the instruction that defines it (``"while.3"``).
      dtype, shape, nbytes: the value's HLO type and size.
      moves: the ops applied to it on the way (``("convert",)``).
    """

    value: str
    instruction: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    moves: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Program:
    """The optimized module's instruction sequence and buffers, parsed from one dump.

    Attributes:
      sequence: the flattened instruction sequence (a while body once, before its ``while``).
      buffers: every value of a counted allocation (:data:`COUNTED_KINDS`) with a live range.
      allocations: allocation number -> (size, kind, color) for every allocation.
      trips: while-body computation -> (the ``while`` instruction, its known trip count or 1).
      instructions: every instruction of the module by name (fused computations' included).
    """

    sequence: tuple[Instruction, ...]
    buffers: tuple[Buffer, ...]
    allocations: dict[int, tuple[int, str, int]]
    trips: dict[str, tuple[str, int]]
    instructions: dict[str, Instruction] = dataclasses.field(default_factory=dict)

    def origin(self, name: str) -> Origin | None:
        """The value instruction ``name`` holds a moved, cast or re-laid-out form of (``None`` when ``name``
        computes something: its :attr:`Instruction.moves` are empty), following :data:`MOVES` and
        get-tuple-element back to the value that was read.

        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda x: x.astype(jnp.float32).T)  # one fusion of a convert and a transpose: a move
        >>> _, p = compile_with_dump(f.lower(jax.ShapeDtypeStruct((4, 8), jnp.bfloat16)))
        >>> any(p.origin(i.name) and p.origin(i.name).dtype == "bf16" for i in p.sequence)
        True
        """
        i = self.instructions.get(name)
        if i is None or not i.moves:
            return None
        moves: list[str] = []
        while i is not None and i.moves and len(i.operands) == 1 and len(moves) < len(self.instructions):
            moves += i.moves
            name, i = i.operands[0], self.instructions.get(i.operands[0])
        # A tuple element: a get-tuple-element chain, or the ``x#2`` operand XLA >= 0.12 prints in its place.
        indices: list[int] = []
        element = i if i is not None and i.opcode == "get-tuple-element" else None
        while True:
            if i is None and "#" in name:
                name, k = name.rsplit("#", 1)
                indices.insert(0, int(k))
                i = self.instructions.get(name)
            elif i is not None and i.opcode == "get-tuple-element" and i.index is not None and len(i.operands) == 1:
                indices.insert(0, i.index)
                name, i = i.operands[0], self.instructions.get(i.operands[0])
            else:
                break
        if i is None:
            return None
        value = f"{name}{{{','.join(map(str, indices))}}}" if indices else name
        held = self._by_name.get(value)
        if held is not None:
            dtype, shape, nbytes = held.dtype, held.shape, held.nbytes
        else:  # a value of an uncounted allocation (a constant): its type as the HLO states it
            typed = element or (i if not indices else None)
            dtype, shape = (typed.dtype, typed.shape) if typed else ("", ())
            nbytes = _nbytes(dtype, shape)
        return Origin(value, name, dtype, shape, nbytes, tuple(moves))

    def carried(self, value: str) -> str | None:
        """The loop output a value of a ``while`` body is: ``"while.3{2}"`` for the body parameter's element 2
        (the carried value before this trip's update) or the instruction the body returns as element 2 (a
        scan's stacked output filled in place); None for any other value."""
        name, _, index = value.partition("{")
        i = self.instructions.get(name)
        loop = self.trips.get(i.computation) if i is not None else None
        if loop is None:
            return None
        if i.opcode == "parameter" and index.rstrip("}").isdigit():
            return f"{loop[0]}{{{index.rstrip('}')}}}"
        root = self._roots.get(i.computation)
        if index or root is None or root.opcode != "tuple" or name not in root.operands:
            return None
        return f"{loop[0]}{{{root.operands.index(name)}}}"

    def annotated(self, name: str) -> Instruction | None:
        """The instruction whose ``op_name`` metadata says what instruction ``name`` computes: ``name`` itself
        when it carries one, else (a fusion XLA made, which carries none) the root of the computation it calls,
        followed through data movement (:data:`MOVES`) to the first instruction that carries one; None when
        none does (a fusion of nothing but moves of its parameters: :meth:`origin` says what it moves).

        >>> import jax, jax.numpy as jnp
        >>> f = jax.jit(lambda x: jnp.sin(x).T * 2)  # one fusion, its root a multiply
        >>> _, p = compile_with_dump(f.lower(jax.ShapeDtypeStruct((4, 8), jnp.float32)))
        >>> sorted({p.annotated(i.name).op_name.rsplit("/", 1)[-1] for i in p.sequence if i.opcode == "fusion"})
        ['mul']
        """
        i, seen = self.instructions.get(name), set()
        while i is not None and i.name not in seen:
            seen.add(i.name)
            if i.op_name:
                return i
            if i.calls and i.calls in self._roots:
                i = self._roots[i.calls]
            elif i.opcode in MOVES and len(i.operands) == 1:
                i = self.instructions.get(i.operands[0])
            else:
                return None
        return None

    @functools.cached_property
    def _roots(self) -> dict[str, Instruction]:
        return {i.computation: i for i in self.instructions.values() if i.root}

    @functools.cached_property
    def _by_name(self) -> dict[str, Buffer]:
        out: dict[str, Buffer] = {}
        for b in self.buffers:
            out.setdefault(b.name, b)
        return out

    @functools.cached_property
    def _by_position(self) -> list[list[Buffer]]:
        starts: list[list[Buffer]] = [[] for _ in self.sequence]
        for b in self.buffers:
            for t in range(max(b.start, 0), min(b.end, len(self.sequence) - 1) + 1):
                starts[t].append(b)
        return starts

    def live_at(self, position: int) -> tuple[Buffer, ...]:
        """The buffers occupying memory at ``position``: per allocation, values whose byte slices overlap an
        earlier-listed live value (a loop's phi alias, an in-place update) are counted once."""
        out, taken = [], {}
        # Real values before phi aliases, larger first: the alias of a slice adds no bytes.
        for b in sorted(self._by_position[position], key=lambda b: (b.phi, -b.nbytes, b.name)):
            spans = taken.setdefault(b.allocation, [])
            if any(b.offset < hi and lo < b.offset + b.nbytes for lo, hi in spans):
                continue
            spans.append((b.offset, b.offset + b.nbytes))
            out.append(b)
        return tuple(out)

    def live_bytes(self, host: bool = False) -> list[int]:
        """Bytes live at each position of :attr:`sequence` (device memory, or host memory with ``host``)."""
        return [sum(b.nbytes for b in self.live_at(t) if b.host == host) for t in range(len(self.sequence))]

    @property
    def peak_position(self) -> int:
        """The position where the most device bytes are live (the first, on a tie)."""
        live = self.live_bytes()
        return live.index(max(live)) if live else 0

    def loops(self, position: int) -> tuple[tuple[str, int], ...]:
        """The ``(while, trip count)`` loops around ``position``, outermost first."""
        chain = []
        comp = self.sequence[position].computation
        parents = {c: w for c, w in self.trips.items()}
        owner = {i.name: i.computation for i in self.sequence}
        while comp in parents:
            name, trips = parents[comp]
            chain.append((name, trips))
            comp = owner.get(name, "")
        return tuple(reversed(chain))

    def expanded(self) -> list[int]:
        """Positions in execution order, each loop body repeated once per trip (nested loops multiply)."""
        chains = [self.loops(t) for t in range(len(self.sequence))]

        def walk(positions: Sequence[int], depth: int) -> list[int]:
            out: list[int] = []
            i = 0
            while i < len(positions):
                chain = chains[positions[i]]
                if len(chain) <= depth:
                    out.append(positions[i])
                    i += 1
                    continue
                j = i
                while j < len(positions) and chains[positions[j]][depth : depth + 1] == chain[depth : depth + 1]:
                    j += 1
                out += walk(positions[i:j], depth + 1) * chain[depth][1]
                i = j
            return out

        return walk(range(len(self.sequence)), 0)


# ---- the compile ----------------------------------------------------------------------------------


def compile_with_dump(lowered, directory: str | None = None):
    """Compile ``lowered`` with XLA's dump switched on and parse the optimized module's dump.

    Args:
      lowered: a ``jax.stages.Lowered``.
      directory: where XLA writes (default: a temporary directory, removed afterwards).

    Returns:
      ``(compiled, Program)``.

    Raises:
      DumpFormatError: XLA wrote no dump, or one this module cannot read.
    """
    if directory is not None:
        return _compile_into(lowered, directory)
    with tempfile.TemporaryDirectory(prefix="remat_kit_xla_") as tmp:
        return _compile_into(lowered, tmp)


def _compile_into(lowered, directory: str):
    options = {"xla_dump_to": directory, "xla_dump_hlo_as_text": True}
    compiled = lowered.compile(compiler_options=options)
    return compiled, read_dump(directory)


def _one(directory: str, suffix: str) -> str:
    # One module per compile; a reused directory may hold older modules: take the newest module number.
    paths = sorted(glob.glob(os.path.join(directory, f"module_*{suffix}")))
    if not paths:
        raise DumpFormatError(f"XLA wrote no '*{suffix}' under {directory}: the dump options or file names changed")
    with open(paths[-1]) as f:
        return f.read()


def read_dump(directory: str) -> Program:
    """Parse the optimized module's dump files in ``directory`` into a :class:`Program`."""
    hlo = _one(directory, "after_optimizations.txt")
    assignment = _one(directory, "after_optimizations-buffer-assignment.txt")
    ranges = _one(directory, "after_optimizations-live-range.txt")
    instructions, trips = parse_hlo(hlo)
    sequence_names, live = parse_live_ranges(ranges)
    sequence = _sequence(sequence_names, instructions)
    allocations, values = parse_buffer_assignment(assignment)
    buffers = []
    for v in values:
        _, kind, color, parameter = allocations[v["allocation"]]
        if kind not in COUNTED_KINDS or v["name"] not in live:
            continue
        start, end = live[v["name"]]
        buffers.append(
            Buffer(
                name=v["name"],
                instruction=v["name"].split("{", 1)[0],
                shape=v["shape"],
                dtype=v["dtype"],
                nbytes=v["size"],
                allocation=v["allocation"],
                offset=v["offset"],
                kind=kind,
                color=color,
                parameter=parameter,
                phi=v["phi"],
                start=start,
                end=end,
            )
        )
    if not buffers:
        raise DumpFormatError("the buffer assignment and the live ranges share no value: the formats changed")
    allocs = {k: (size, kind, color) for k, (size, kind, color, _) in allocations.items()}
    return Program(
        sequence=sequence, buffers=tuple(buffers), allocations=allocs, trips=trips, instructions=instructions
    )


def _sequence(names: list[str], instructions: dict[str, Instruction]) -> tuple[Instruction, ...]:
    """The sequence's instructions; XLA >= 0.12's printer elides get-tuple-element (``%t#1``) from the HLO text
    while the live ranges still list it (under any name): such a one sits in its neighbour's computation."""
    missing = [n for n in names if n not in instructions]
    if missing and not any(i.opcode == "elided-gte" for i in instructions.values()):
        raise DumpFormatError(f"live-range sequence names instructions the HLO does not define: {missing[:3]}")
    out: list[Instruction] = []
    for i, name in enumerate(names):
        if name in instructions:
            out.append(instructions[name])
            continue
        near = next((instructions[n] for n in names[i + 1 :] if n in instructions), None)
        comp = out[-1].computation if out else near.computation if near else ""
        out.append(Instruction(name=name, computation=comp, opcode="get-tuple-element", op_name="", source=""))
    return tuple(out)


# ---- the parsers ----------------------------------------------------------------------------------

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s+(ROOT\s+)?%?([\w.\-]+)\s+=\s+(.+?)\s+([\w\-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_SOURCE = re.compile(r'source_file="([^"]*)"\s+source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TRIPS = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_BODY = re.compile(r"body=%?([\w.\-]+)")
_COND = re.compile(r"condition=%?([\w.\-]+)")
_PARAMETER = re.compile(r"^(\d+)\)")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_INDEX = re.compile(r"index=(\d+)")
_OPERAND = re.compile(r"%([\w.\-]+(?:#\d+)?)")


def _nbytes(dtype: str, shape: Sequence[int]) -> int:
    n = _DTYPE_BYTES.get(dtype, 0)
    for d in shape:
        n *= d
    return n


def _arguments(rest: str) -> str:
    """The operand list of an instruction: ``rest`` up to the ``)`` closing its opcode's ``(``."""
    depth = 0
    for k, ch in enumerate(rest):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return rest[:k]
            depth -= 1
    return rest


def _attributes(rest: str) -> str:
    """An instruction's attributes: ``rest`` after its operand list, before its metadata (whose strings may
    hold anything)."""
    return rest[len(_arguments(rest)) :].split("metadata={", 1)[0]


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict[str, tuple[str, int]]]:
    """``(instruction name -> Instruction, loop body or condition -> (while, trip count))`` of an HLO text dump."""
    tables = _stack_tables(text)
    instructions, trips = {}, {}
    fused: dict[str, str] = {}  # fusion -> the computation it calls
    opcodes: dict[str, list[str]] = {}  # computation -> its instructions' opcodes
    comp, entry, elided = "", False, False
    for line in text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            comp, entry = m.group(2), bool(m.group(1))
            continue
        m = _INSTRUCTION.match(line)
        if not m or not comp:
            continue
        if "#" in m.group(5) and re.search(r"%[\w.\-]+#\d", m.group(5)):
            elided = True
        name, opcode, rest = m.group(2), m.group(4), m.group(5)
        op = _OP_NAME.search(rest)
        parameter = None
        if opcode == "parameter" and entry:
            p = _PARAMETER.match(rest)
            parameter = int(p.group(1)) if p else None
        array = _ARRAY.match(m.group(3))
        index = _INDEX.search(rest) if opcode == "get-tuple-element" else None
        calls = _CALLS.search(_attributes(rest))
        if calls and opcode == "fusion":
            fused[name] = calls.group(1)
        opcodes.setdefault(comp, []).append(opcode)
        instructions[name] = Instruction(
            name=name,
            computation=comp,
            opcode=opcode,
            op_name=_unescape(op.group(1)) if op else "",
            source=_source(rest, tables),
            parameter=parameter,
            operands=tuple(_OPERAND.findall(_arguments(rest))),
            index=int(index.group(1)) if index else None,
            moves=(opcode,) if opcode in MOVES else (),
            dtype=array.group(1) if array else "",
            shape=tuple(int(d) for d in array.group(2).split(",") if d) if array else (),
            root=bool(m.group(1)),
            calls=calls.group(1) if calls else "",
        )
        if opcode == "while":
            n = _TRIPS.search(rest)
            for pattern in (_BODY, _COND):
                called = pattern.search(rest)
                if called:
                    trips[called.group(1)] = (name, int(n.group(1)) if n else 1)
    if not instructions:
        raise DumpFormatError("no HLO instruction parsed from the optimized module: the text format changed")
    # A fusion of one parameter and nothing but data movement (XLA's ``wrapped_convert``) moves like its ops.
    for name, comp in fused.items():
        ops = opcodes.get(comp, [])
        body = tuple(dict.fromkeys(o for o in ops if o != "parameter"))
        if ops.count("parameter") == 1 and body and set(body) <= set(MOVES) and len(instructions[name].operands) == 1:
            instructions[name] = dataclasses.replace(instructions[name], moves=body)
    if elided:  # a marker :func:`_sequence` reads: this printer writes ``%t#1`` for get-tuple-element
        instructions["%elided-gte"] = Instruction("%elided-gte", "", "elided-gte", "", "")
    return instructions, trips


def _unescape(text: str) -> str:
    """An HLO string attribute as written in Python: ``params[\\'w\\']`` -> ``params['w']``."""
    return text.replace("\\'", "'").replace('\\"', '"')


def _stack_tables(text: str) -> dict[str, dict[int, tuple[int, ...]]]:
    """The ``FileNames`` / ``FunctionNames`` / ``FileLocations`` / ``StackFrames`` tables of a dump."""
    tables: dict[str, dict] = {"FileNames": {}, "FunctionNames": {}, "FileLocations": {}, "StackFrames": {}}
    current = None
    for line in text.splitlines():
        if line.strip() in tables:
            current = line.strip()
            continue
        if current is None:
            continue
        if not line.strip():
            current = None if current == "StackFrames" else current
            continue
        m = re.match(r"^(\d+)\s+(.*)$", line.strip())
        if not m:
            current = None
            continue
        key, body = int(m.group(1)), m.group(2)
        if current in ("FileNames", "FunctionNames"):
            tables[current][key] = body.strip('"')
        else:
            tables[current][key] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", body)}
    return tables


def _source(rest: str, tables) -> str:
    m = _SOURCE.search(rest)
    if m:
        return f"{os.path.basename(m.group(1))}:{m.group(2)}"
    m = _FRAME.search(rest)
    if not m:
        return ""
    frame = tables["StackFrames"].get(int(m.group(1)), {})
    loc = tables["FileLocations"].get(frame.get("file_location_id", -1), {})
    if not loc:
        return ""
    file = tables["FileNames"].get(loc.get("file_name_id", -1), "?")
    func = tables["FunctionNames"].get(loc.get("function_name_id", -1), "")
    return f"{os.path.basename(file)}:{loc.get('line', 0)}" + (f" ({func})" if func else "")


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):\s*$")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+)( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_ARRAY = re.compile(r"^(\w+)\[([\d,]*)\]")


def parse_buffer_assignment(text: str):
    """``(allocation -> (size, kind, color, parameter), [value dicts])`` of a buffer-assignment dump."""
    allocations, values = {}, []
    current = None
    for line in text.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            current, flags = int(m.group(1)), m.group(3)
            param = re.search(r"parameter (\d+)", flags)
            color = re.search(r"color (\d+)", flags)
            if param:
                kind = "parameter"
            elif "constant" in flags:
                kind = "constant"
            elif "thread-local" in flags:
                kind = "thread-local"
            elif "maybe-live-out" in flags:
                kind = "output"
            else:
                kind = "temp"
            allocations[current] = (
                int(m.group(2)),
                kind,
                int(color.group(1)) if color else 0,
                int(param.group(1)) if param else None,
            )
            continue
        m = _VALUE.match(line)
        if m and current is not None:
            array = _ARRAY.match(m.group(5))
            dtype = array.group(1) if array else "tuple"
            shape = tuple(int(d) for d in array.group(2).split(",") if d) if array else ()
            values.append(
                {
                    "name": m.group(1).removesuffix("{}"),
                    "phi": bool(m.group(2)),
                    "size": int(m.group(3)),
                    "offset": int(m.group(4)),
                    "dtype": dtype,
                    "shape": shape,
                    "allocation": current,
                }
            )
        elif line.startswith("Used values:") or line.startswith("Total bytes used"):
            break
    if not allocations or not values:
        raise DumpFormatError("no allocation or value parsed from the buffer assignment: the format changed")
    return allocations, values


def parse_live_ranges(text: str) -> tuple[list[str], dict[str, tuple[int, int]]]:
    """``(the instruction sequence, value -> (start, end))`` of a live-range dump."""
    sequence, live = [], {}
    part = None
    for line in text.splitlines():
        s = line.strip()
        if s == "InstructionSequence:":
            part = "sequence"
        elif s == "BufferLiveRange:":
            part = "ranges"
        elif s.startswith("Live ranges at") or s.startswith("Stack trace"):
            part = None
        elif part == "sequence":
            m = re.match(r"^(\d+):(\S+)$", s)
            if m:
                sequence.append(m.group(2))
        elif part == "ranges":
            m = re.match(r"^(\S+):(-?\d+)-(-?\d+)$", s)
            if m:
                live[m.group(1).removesuffix("{}")] = (int(m.group(2)), int(m.group(3)))
    if not sequence or not live:
        raise DumpFormatError("no instruction sequence or live range parsed: the live-range format changed")
    return sequence, live
