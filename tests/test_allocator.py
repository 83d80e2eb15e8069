"""remat_kit.step.allocator: on CPU, a freed buffer leaves the process (checked in a fresh one), bad values."""

import subprocess
import sys

import pytest

from remat_kit.step import allocator

# A fresh process frees an 8 MB buffer twice and reports the anonymous memory the second one left resident.
_PROBE = """
import ctypes, sys
from remat_kit.step import allocator
if sys.argv[1] == "fixed":
    assert allocator.return_freed_buffers()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
def use_and_free(size=8 << 20):
    p = libc.malloc(size)
    ctypes.memset(p, 1, size)
    libc.free(p)
use_and_free()  # mmapped and unmapped; glibc's default then raises its threshold to 8 MB
base = anon()
use_and_free()  # by default from the heap now, and kept when freed
print(anon() - base)
"""


def _resident_after_free(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True)
    return int(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_a_freed_buffer_leaves_the_process():
    assert _resident_after_free("default") >= 4 << 20  # glibc's dynamic threshold keeps the freed 8 MB
    assert _resident_after_free("fixed") < 1 << 20


def test_other_platforms_change_nothing(monkeypatch):
    assert allocator.return_freed_buffers(platform="gpu") is False  # device buffers are not the C allocator's
    monkeypatch.setattr(allocator.sys, "platform", "darwin")
    assert allocator.return_freed_buffers(platform="cpu") is False


@pytest.mark.parametrize(
    ("threshold", "match"),
    [
        (0, r"threshold must be a positive integer, got 0"),
        (-1, r"threshold must be a positive integer, got -1"),
        (1.5, r"threshold must be a positive integer, got 1\.5"),
        (True, r"threshold must be a positive integer, got True"),
        ("64k", r"threshold must be a positive integer, got '64k'"),
        (64 << 20, r"threshold must be at most 33554432 bytes \(glibc's cap\), got 67108864"),
    ],
    ids=repr,
)
def test_bad_threshold_one_line(threshold, match):
    with pytest.raises(ValueError, match=match):
        allocator.return_freed_buffers(threshold)
