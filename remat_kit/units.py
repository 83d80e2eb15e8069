"""Memory sizes and FLOP counts: parsing ("80GB") and printing ("2.03 GB", "29.1 T")."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
}


def parse_bytes(text: str | int) -> int:
    """Parse a memory size with any unit: ``"80GB"``, ``"24 GiB"``, ``"1.5e9"``, ``"512MiB"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000, binary ones (KiB … TiB) of 1024.

    Raises:
      ValueError: an unparseable or non-positive size, naming it and the accepted units.

    >>> parse_bytes("80GB"), parse_bytes("1 GiB"), parse_bytes(1024)
    (80000000000, 1073741824, 1024)
    """
    if isinstance(text, bool):
        raise TypeError(f"a memory size must be a string or an int, got {text!r}")
    if isinstance(text, int):
        value = text
    else:
        # A sign is read (so that "-5GB" is refused as not positive, below, rather than as unreadable).
        match = re.fullmatch(r"\s*([+-]?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(
                f"cannot read memory size {text!r}; write a number with a unit: B, KB, MB, GB, TB, "
                f"KiB, MiB, GiB, TiB (e.g. 80GB)"
            )
        number = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(number):  # "1e400GB": int() of an infinite float would raise OverflowError
            raise ValueError(f"memory size {text!r} is too large to be a number of bytes")
        value = int(number)
    if value <= 0:
        raise ValueError(f"a memory budget must be positive, got {text!r}")
    return value


def fmt_bytes(n: float) -> str:
    """Decimal units, as the seed quotes them (GB from 0.1 GB on).

    >>> fmt_bytes(234_881_024), fmt_bytes(2_031_616_000), fmt_bytes(58_720_256), fmt_bytes(512)
    ('0.23 GB', '2.03 GB', '58.7 MB', '512 B')
    """
    for unit, scale, start in (("GB", 1e9, 1e8), ("MB", 1e6, 1e6), ("kB", 1e3, 1e3)):
        if abs(n) >= start:
            value = n / scale
            return f"{value:.2f} {unit}" if unit == "GB" else f"{value:.1f} {unit}"
    return f"{int(n)} B"


def fmt_bytes_beside(n: float, other: float) -> str:
    """``n`` as :func:`fmt_bytes` writes it, with as many more digits as it takes to tell it from ``other``
    (a need "over" a budget must not print as the budget itself).

    >>> fmt_bytes_beside(200_300_000, 200_000_000), fmt_bytes_beside(5_012_000, 5_000_000)
    ('0.2003 GB', '5.01 MB')
    >>> fmt_bytes_beside(300_000_000, 200_000_000)
    '0.30 GB'
    """
    text = fmt_bytes(n)
    if n == other or text != fmt_bytes(other):
        return text
    unit = text.split()[-1]
    scale = {"GB": 1e9, "MB": 1e6, "kB": 1e3}.get(unit)
    if scale is None:
        return text
    for digits in range(2, 10):
        a, b = f"{n / scale:.{digits}f}", f"{other / scale:.{digits}f}"
        if a != b:
            return f"{a} {unit}"
    return f"{int(n):,} B"


def fmt_flops(n: float) -> str:
    """FLOPs with a decimal prefix, three significant digits.

    >>> fmt_flops(2.91e13), fmt_flops(2_097_152), fmt_flops(0)
    ('29.1 T', '2.1 M', '0')
    """
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)}"


def fmt_seconds(s: float) -> str:
    """An estimated time: milliseconds below a second, three significant digits; exactly 0 as ``0``.

    >>> fmt_seconds(0), fmt_seconds(0.01234), fmt_seconds(2.5)
    ('0', '12.3 ms', '2.5 s')
    """
    return "0" if s == 0 else f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def fmt_count(n: float) -> str:
    """A count (parameters, tokens) with k, M, B (billions) or T, three significant digits.

    >>> fmt_count(1_234_567), fmt_count(2.6e9), fmt_count(512), fmt_count(45_000)
    ('1.23 M', '2.6 B', '512', '45 k')
    """
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)}"


class NotAnIntegerError(TypeError, ValueError):
    """A value that should be an integer is of another type (a bool, a float, a string...).

    Both a TypeError (its type is wrong) and a ValueError (what callers of a config check catch).
    """


def check_int(what: str, value, low: int = 1, *, none_ok: bool = False) -> int | None:
    """The one integer check of the package: ``value`` must be an int (not a bool) >= ``low``.

    Args:
      what: the name the message gives the value.
      value: the value to check.
      low: the smallest allowed value.
      none_ok: None is allowed too (and returned).

    Raises:
      NotAnIntegerError: ``value`` is not an int (a TypeError and a ValueError).
      ValueError: ``value`` is below ``low``. Both messages name ``what``, what is allowed and the value.

    >>> check_int("steps", 3)
    3
    >>> check_int("steps", 2.0)
    Traceback (most recent call last):
    ...
    remat_kit.units.NotAnIntegerError: steps must be a positive integer, got 2.0
    """
    if none_ok and value is None:
        return None
    allowed = "a positive integer" if low == 1 else f"an integer >= {low}"
    allowed += " or None" if none_ok else ""
    if isinstance(value, bool) or not isinstance(value, int):
        raise NotAnIntegerError(f"{what} must be {allowed}, got {value!r}")
    if value < low:
        raise ValueError(f"{what} must be {allowed}, got {value!r}")
    return value
