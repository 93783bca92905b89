"""Every command the README writes runs as written after `source .venv/bin/activate`: each one's program is on
the environment's PATH and its `--help` works (the jobs themselves run in the tests of each job)."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, subprocess_env

BIN = Path(sys.executable).parent  # the environment's bin folder, which `source .venv/bin/activate` puts first


def readme_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", " ", block)  # continuation lines
        lines += [re.sub(r"\s+#.*$", "", ln).strip() for ln in joined.splitlines()]
    return [ln for ln in lines if ln]


def help_form(line: str):
    """The `--help` form of a command line: its program, module or script, and subcommand."""
    words = shlex.split(line.split("&&")[-1].strip())
    while words and "=" in words[0]:  # VAR=value prefixes
        words.pop(0)
    prog, rest = words[0], words[1:]
    if prog in ("bash", "source"):
        return None  # the set-up script and the activation: run by CI itself
    if prog == "vllm" or prog.startswith(".venv-serve/"):
        return None  # the serving environment's programs: tests/serve/test_serve_vllm.py runs them there
    if prog.endswith("python") or prog == "python":
        head = rest[:2] if rest[0] == "-m" else rest[:1]
        if head[-1] == "pytest":
            return None
        sub = rest[len(head):len(head) + 1] if head[-1] in ("hybridlm.data",) else []
        return ["python", *head, *sub, "--help"]
    if prog == "deepspeed":
        return ["deepspeed", "--help"]
    return [prog, rest[0], "--help"] if rest and not rest[0].startswith("-") else [prog, "--help"]


def test_readme_has_commands_for_each_job():
    firsts = {shlex.split(c.split("&&")[-1])[0] for c in readme_commands()}
    assert {"python", "upcycle", "hybrid-eval", "deepspeed"} <= firsts


@pytest.mark.slow  # ~90 s: a fresh interpreter per command
def test_every_readme_command_runs_as_written():
    forms = []
    for line in readme_commands():
        form = help_form(line)
        if form and form not in forms:
            forms.append(form)
    assert len(forms) >= 10
    env = subprocess_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.pop("PYTHONPATH")  # as a user's shell: the installed package, not the test's path
    failed = []
    for form in forms:
        res = subprocess.run(form, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        if res.returncode != 0 or "usage" not in res.stdout.lower():
            failed.append(f"{' '.join(form)}: exit {res.returncode}: {(res.stderr or res.stdout)[-300:]}")
    assert not failed, "\n".join(failed)
