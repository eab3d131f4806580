"""``astrai doctor | head``: a reader that stops early ends the command quietly."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["doctor", "--json"], ["doctor"]])
def test_a_closed_pipe_ends_without_a_traceback(args):
    with subprocess.Popen([sys.executable, "-m", "astrai.cli.main", *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as proc:
        proc.stdout.close()  # the reader is gone before the first byte: every write is EPIPE
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=300) == 1
    assert err == ""


def test_head_of_doctor_json_reads_the_start(tmp_path):
    result = subprocess.run(f"{sys.executable} -m astrai.cli.main doctor --json | head -n 3", shell=True,
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.splitlines()[0] == "{" and '"astrai"' in result.stdout
    assert "Traceback" not in result.stderr and "BrokenPipeError" not in result.stderr
