"""The wait between Ctrl-C and exit of ``remat-kit plan --preset small``, at moments from start-up to mid-compile.

Each trial starts the command as a shell starts a job (SIGINT at its default disposition, its own process
group), sends SIGINT to the group as a terminal's Ctrl-C does at one moment, and times the exit. The moments:
fixed delays after the start (importing JAX, building the model) and the progress lines of the first
compiles, at once and a second later (mid-compile). One full run first gives the compile times the waits
are compared with (issue 39: at most one compile). Wall-clock, on whatever load the machine has.

    PYTHONPATH=. python benchmarks/interrupt_wait.py [--preset small] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

#: Starts the CLI with SIGINT at its default disposition (a caller may run with it ignored), as a shell does.
LAUNCH = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_DFL)\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'remat_kit.cli', *sys.argv[1:]])\n"
)


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", LAUNCH, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
    )


def trial(argv: list[str], delay: float | None, line: str | None) -> dict:
    """One run: SIGINT ``delay`` seconds after the start, or ``delay`` seconds after a stderr line holding ``line``."""
    start = time.monotonic()
    proc = _start(argv)
    if line is not None:
        for text in proc.stderr:
            if line in text:
                break
        else:
            raise RuntimeError(f"the run ended before a {line!r} line")
    time.sleep(delay or 0.0)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=600)
    waited = time.monotonic() - sent
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return {"at_s": round(sent - start, 2), "wait_s": round(waited, 3), "rc": proc.returncode, "last_line": last}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--repeat", type=int, default=1, help="trials per moment")
    args = p.parse_args(argv)
    plan = ["plan", "--preset", args.preset]

    with tempfile.TemporaryDirectory() as tmp:  # the compile times the waits are measured against
        path = os.path.join(tmp, "plan.json")
        full_start = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "remat_kit.cli", *plan, "--json", path, "--no-progress"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        full_s = time.monotonic() - full_start
        with open(path) as f:
            compiles = {r["policy"]: r["compile_s"] for r in json.load(f)["records"]}

    moments = [(d, None, f"{d:g} s after the start") for d in (0.25, 0.5, 1.0, 2.0, 3.0)]
    for i, spec in enumerate(list(compiles)[:3], start=1):
        marker = f"[{i}/{len(compiles)}] {spec}:"
        moments += [(0.0, marker, f"at the {marker} line"), (1.0, marker, f"1 s after the {marker} line")]
    rows = []
    for delay, line, what in moments:
        for _ in range(args.repeat):
            rows.append((what, trial(plan, delay, line)))

    print(f"remat-kit {' '.join(plan)}: one full run {full_s:.1f} s (--jobs 2); compile_s per policy:")
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in compiles.items()))
    print(f"  shortest compile {min(compiles.values()):.1f} s, longest {max(compiles.values()):.1f} s\n")
    print(f"{'Ctrl-C':34} {'sent at':>8} {'wait':>8}  exit  last stderr line")
    for what, r in rows:
        print(f"{what:34} {r['at_s']:7.2f}s {r['wait_s']:7.3f}s  {r['rc']:4}  {r['last_line']}")
    worst = max(r["wait_s"] for _, r in rows)
    print(
        f"\nlongest wait between Ctrl-C and exit: {worst:.3f} s over {len(rows)} trials; every exit 130: "
        f"{all(r['rc'] == 130 for _, r in rows)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
