"""The README's quickstart and CI's script must not drift apart; a wheel must carry its data."""

import os
import re
import subprocess
import sys
import zipfile

from conftest import ROOT


def _commands():
    text = open(os.path.join(ROOT, "README.md")).read()
    quick = text.split("## Quickstart", 1)[1].split("## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", quick)


def test_quickstart_has_exactly_two_commands():
    commands = _commands()
    assert len(commands) == 2, commands
    assert "attngen check specs/" in commands[0] and "pytest" in commands[1]


def test_ci_runs_the_readme_test_command():
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    assert _commands()[1] in ci.splitlines()


def test_wheel_contains_templates_and_grammar(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), ROOT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (wheel,) = [f for f in os.listdir(tmp_path) if f.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    assert "attngen/lang/attn.lark" in names and "attngen/templates/attention.py.j2" in names
