"""The skip policy (tests/support/baton_testing/skip_policy.py), run over tiny generated test files in a
pytest subprocess: under CI a skip fails the session unless the test is GPU-only, a local run still
skips, and the summary lists the GPU-only tests with the date they last ran on a GPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from baton_testing.skip_policy import describe_gpu_run, last_gpu_run

SUPPORT = Path(__file__).resolve().parent / "support"
RECORD = {"date": "2026-01-02", "card": "NVIDIA H200", "commit": "0123456789abcdef", "passed": 3, "failed": 0}

PASSES = "def test_passes():\n    assert 1 + 1 == 2\n"
GPU_SKIP = textwrap.dedent("""
    import pytest

    @pytest.mark.gpu
    @pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
    def test_on_cuda(dtype):
        pytest.skip("needs a CUDA device")
""")
PLAIN_SKIP = textwrap.dedent("""
    import pytest

    def test_needs_something():
        pytest.skip("triton is not installed")
""")
MODULE_SKIP = 'import pytest\npytest.importorskip("no_such_module_here", reason="a test dependency")\n\n' + PASSES


def run(tmp_path: Path, files: dict[str, str], ci: str | None, *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (tmp_path / "record.json").write_text(json.dumps(RECORD))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTEST_ADDOPTS")}
    env.update(PYTHONPATH=str(SUPPORT), BATON_GPU_RECORD=str(tmp_path / "record.json"))
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "baton_testing.skip_policy", "-q",
                           "-p", "no:cacheprovider", str(tmp_path), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_under_ci_a_skip_that_is_not_gpu_only_fails_the_session(tmp_path):
    r = run(tmp_path, {"test_a.py": PASSES + PLAIN_SKIP, "test_gpu.py": GPU_SKIP}, ci="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "SKIP NOT ALLOWED test_a.py::test_needs_something: triton is not installed" in r.stdout
    assert "test_on_cuda" not in r.stdout.split("SKIP NOT ALLOWED")[1].split("\n")[0]


def test_under_ci_gpu_only_skips_pass_and_the_summary_lists_them(tmp_path):
    r = run(tmp_path, {"test_a.py": PASSES, "test_gpu.py": GPU_SKIP}, ci="1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SKIP NOT ALLOWED" not in r.stdout
    assert "GPU-only tests: 2 collected, 0 ran here" in r.stdout
    assert "test_gpu.py::test_on_cuda[float16] [skipped]" in r.stdout
    assert "test_gpu.py::test_on_cuda[bfloat16] [skipped]" in r.stdout
    assert "last ran on a GPU: 2026-01-02 on NVIDIA H200, commit 0123456789ab (3 passed, 0 failed)" in r.stdout


def test_deselected_gpu_tests_are_still_counted(tmp_path):
    r = run(tmp_path, {"test_a.py": PASSES, "test_gpu.py": GPU_SKIP}, "1", "-m", "not gpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "GPU-only tests: 2 collected, 0 ran here" in r.stdout
    assert "test_gpu.py::test_on_cuda[float16] [not run]" in r.stdout


def test_a_module_skipped_at_collection_fails_under_ci(tmp_path):
    r = run(tmp_path, {"test_m.py": MODULE_SKIP}, ci="1")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "SKIP NOT ALLOWED test_m.py: a test dependency" in r.stdout


def test_a_local_run_still_skips(tmp_path):
    for ci in (None, "0", "false"):
        r = run(tmp_path, {"test_a.py": PASSES + PLAIN_SKIP}, ci=ci)
        assert r.returncode == 0, (ci, r.stdout + r.stderr)
        assert "1 passed, 1 skipped" in r.stdout and "SKIP NOT ALLOWED" not in r.stdout


def test_fail_on_skip_makes_a_local_run_strict(tmp_path):
    r = run(tmp_path, {"test_a.py": PASSES + PLAIN_SKIP}, None, "--fail-on-skip")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "SKIP NOT ALLOWED" in r.stdout


def test_a_failure_keeps_its_own_exit_status(tmp_path):
    r = run(tmp_path, {"test_a.py": "def test_fails():\n    assert False\n" + PLAIN_SKIP}, ci="1")
    assert r.returncode == 1 and "1 failed" in r.stdout, r.stdout + r.stderr


def test_the_checked_in_record_names_date_card_and_commit():
    record = last_gpu_run(SUPPORT.parent / "gpu_last_run.json")
    assert record is not None and {"date", "card", "commit", "passed", "failed"} <= set(record)
    assert describe_gpu_run(record).startswith(f"{record['date']} on {record['card']}, commit ")
    assert describe_gpu_run(None).startswith("never recorded")
