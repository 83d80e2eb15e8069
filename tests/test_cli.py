import subprocess
import sys

from remat_kit import cli


def test_policies_command_lists_policies_and_tags(capsys):
    assert cli.main(["policies", "minimal"]) == 0
    out = capsys.readouterr().out
    assert "every_n:N" in out and "layer_input" in out and "'minimal' -> selective:q_proj" in out


def test_bad_spec_is_one_line_and_exit_2(capsys):
    assert cli.main(["policies", "fulll"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown policy spec 'fulll'" in err and "Traceback" not in err


def test_console_entry_point_runs_as_module():
    proc = subprocess.run(
        [sys.executable, "-m", "remat_kit.cli", "policies"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert "sqrt_n" in proc.stdout
