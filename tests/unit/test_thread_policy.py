"""Importing async_rl makes OpenMP threads wait passively (async_rl/__init__.py), unless the user chose a policy;
checked in fresh interpreters, where libgomp has not read the environment yet."""

import os
import subprocess
import sys

import pytest

PROBE = "import async_rl, torch, os; print(os.environ['OMP_WAIT_POLICY'])"


@pytest.mark.parametrize("given,expect", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_the_package_sets_a_passive_wait_policy_unless_the_user_chose_one(given, expect):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == expect


def test_the_command_line_imports_the_package_before_torch():
    """async_rl/launch/cli.py's first async_rl import must precede torch's, or libgomp has read the environment already."""
    probe = ("import sys, builtins\norder = []\nreal = builtins.__import__\n"
             "def spy(name, *a, **k):\n    order.append(name.split('.')[0])\n    return real(name, *a, **k)\n"
             "builtins.__import__ = spy\nimport async_rl.launch.cli\n"
             "print(order.index('async_rl') < order.index('torch') if 'torch' in order else True)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "True"
