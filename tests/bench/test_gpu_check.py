"""Every Python command of scripts/gpu_check.sh runs here on the CPU, read from the script
itself: the one-line checks (against a faked CUDA device where they ask one), the benchmark
as --dry-run (tiny sizes, one round), the summary it writes, and the pytest calls as
--setup-plan. Only the build is left to tests/ops/test_cuda_build.py. A renamed argument, a
removed flag or a Python command added without a test fails here, not on the next GPU."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import shlex
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
FAKE_GPU = "Fake GPU (tests/bench)"
BENCH_SECTIONS = {"gpu": 5, "gpu_launches": 5, "gpu_bandwidth": 5}  # impls per case


def python_commands(text: str) -> list[tuple[list[str], str | None]]:
    """(arguments after "$PYTHON", the here-document fed to it or None) of every command of
    the script that runs the interpreter, with redirections and pipes cut off."""
    lines = text.replace("\\\n", " ").splitlines()
    commands = []
    for number, line in enumerate(lines):
        if '"$PYTHON"' not in line or line.lstrip().startswith("#"):
            continue
        heredoc = None
        if match := re.search(r"<<'?(\w+)'?", line):
            end = lines.index(match.group(1), number)
            heredoc = "\n".join(lines[number + 1 : end])
            line = line[: match.start()]
        line = re.sub(r"\s\d*>>?&?\s*(\"[^\"]*\"|\S+)", " ", line)  # redirections
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
        start = tokens.index("$PYTHON") + 1
        args = []
        for token in tokens[start:]:
            if set(token) <= set(";|&()<>"):
                break
            args.append(token)
        commands.append((args, heredoc))
    return commands


COMMANDS = python_commands(SCRIPT.read_text())


def of_kind(kind: str) -> list[tuple[list[str], str | None]]:
    return [command for command in COMMANDS if kind_of(command[0]) == kind]


def kind_of(args: list[str]) -> str:
    if args[0] == "-c":
        return "one-liner"
    if args[0] == "-":
        return "summary"
    if args[:2] == ["-m", "pytest"]:
        return "pytest"
    return Path(args[0]).name


def expand(args: list[str], variables: dict[str, str]) -> list[str]:
    return [string.Template(arg).substitute(variables) for arg in args]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda answers as on a machine with one GPU (for the commands that only ask)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_GPU)


def run_python(code: str, argv: list[str], monkeypatch) -> int:
    """Run ``code`` as ``python -c`` / ``python -`` would, in this process; its exit status."""
    monkeypatch.setattr(sys, "argv", argv)
    try:
        exec(compile(code, str(SCRIPT), "exec"), {"__name__": "__main__"})
    except SystemExit as done:
        return int(done.code or 0)
    return 0


def test_every_python_command_is_covered_here():
    kinds = sorted(kind_of(args) for args, _ in COMMANDS)
    assert kinds == sorted(
        ["one-liner"] * 3 + ["summary", "pytest", "pytest", "setup.py", "bench_kernels.py"]
    )


def test_one_liners_run(fake_cuda, monkeypatch, capsys):
    """The CUDA check passes on the faked GPU, the architecture prints as "9.0", and the
    extension check answers (a CPU build has no CUDA kernels)."""
    from syncbn_lab.nn import _ext

    statuses = [run_python(args[1], ["-c"], monkeypatch) for args, _ in of_kind("one-liner")]
    assert statuses == [0, 0, 0 if _ext.has_cuda_kernels() else 1]
    assert capsys.readouterr().out.split() == ["9.0"]


@pytest.fixture
def bench_kernels(monkeypatch):
    """scripts/bench_kernels.py as a module (its dry run sets one thread: restored after)."""
    threads = torch.get_num_threads()
    yield load_bench_kernels(monkeypatch)
    torch.set_num_threads(threads)


def load_bench_kernels(monkeypatch):
    path = ROOT / "scripts/bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def test_benchmark_and_summary_run_on_the_cpu(bench_kernels, tmp_path, monkeypatch, capsys):
    """The benchmark's command as the script gives it, as a dry run, writes a record of every
    case; the summary reads it and a pytest report (counts computed here by hand)."""
    from syncbn_lab.nn import ops

    if not ops.available(warn=False):
        pytest.skip("syncbn_lab._C is not built")
    ((bench_args, _),) = of_kind("bench_kernels.py")
    variables = {"OUT_DIR": str(tmp_path)}
    assert bench_kernels.main([*expand(bench_args[1:], variables), "--dry-run"]) == 0
    bench = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert bench["meta"]["timing"]["rounds"] == 1 and bench["meta"]["device"] == "cpu"
    sizes = bench_kernels.DRY_RUN_SIZES
    cases = {"gpu": len(sizes.shapes) * 2 * 2, "gpu_launches": 2 * 2, "gpu_bandwidth": 2}
    for section, impls in BENCH_SECTIONS.items():
        rows = [r for r in bench["records"] if r["section"] == section]
        assert len(rows) == cases[section] * impls, section
    for row in bench["records"]:
        assert row.get("fwd_bwd_ms", row.get("ms", row.get("step_us"))) > 0

    (tmp_path / "pytest.xml").write_text(
        '<testsuites><testsuite tests="12" failures="1" errors="2" skipped="4"/></testsuites>'
    )
    ((summary_args, code),) = of_kind("summary")
    variables |= dict(
        build_ok="1", build_s="42", test_rc="1", bench_rc="0", sanitizer_rc="-1", total_s="99"
    )
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: FAKE_GPU)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert run_python(code, expand(summary_args, variables), monkeypatch) == 0
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["tests"] == {"tests": 12, "failures": 1, "errors": 2, "skipped": 4, "passed": 5}
    assert summary["bench"] == bench
    assert (summary["device"], summary["capability"]) == (FAKE_GPU, "9.0")
    assert (summary["build_ok"], summary["build_seconds"], summary["tests_rc"]) == (True, 42, 1)
    assert (summary["sanitizer_rc"], summary["total_seconds"]) == (-1, 99)
    assert str(tmp_path / "gpu_check.json") in capsys.readouterr().out


def test_benchmark_without_a_gpu_says_what_to_run(bench_kernels, monkeypatch, capsys):
    from syncbn_lab.nn import ops

    if not ops.available(warn=False):
        pytest.skip("syncbn_lab._C is not built")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench_kernels.main(["--rounds", "1"]) == 1
    assert "--dry-run checks this script on the CPU" in capsys.readouterr().out


def test_sanitizer_leaves_out_tests_that_exist():
    """Each name the compute-sanitizer call leaves out (-k "not NAME and ...") still matches a
    test of its file: a renamed test would otherwise run under the sanitizer unnoticed."""
    (args, _), *_ = [c for c in of_kind("pytest") if "-k" in c[0]]
    names = re.findall(r"not (\w+)", args[args.index("-k") + 1])
    path = next(ROOT / arg for arg in args if arg.endswith(".py"))
    tests = [
        node.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test")
    ]
    assert len(names) >= 6
    for name in names:
        assert any(name in test for test in tests), name


@pytest.mark.slow
def test_pytest_calls_plan_without_errors(tmp_path):
    """The test runs of the script, with its flags (--noconftest: a test that needs a fixture
    of tests/conftest.py errors here), planned without running (--setup-plan); both at once."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    runs = [
        subprocess.Popen(
            [sys.executable, *expand(args, {"OUT_DIR": str(tmp_path)}), "--setup-plan"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for args, _ in of_kind("pytest")
    ]
    for run in runs:
        out, _ = run.communicate(timeout=120)
        assert run.returncode == 0, out[-3000:]
        assert " error" not in out.splitlines()[-1], out[-3000:]
