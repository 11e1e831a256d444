"""`baton serve` with a model directory it cannot serve: a one-line error before anything starts for a
wrong path, and a clean non-zero exit with no process left behind when the model fails to load."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest

from baton.engine.utils.process import free_port
from engine_server import processes_marked


def _serve(model_path: str, mark: str = "", timeout: float = 240) -> subprocess.CompletedProcess:
    """`mark` goes into the environment, which the spawned scheduler and detokenizer inherit."""
    return subprocess.run([sys.executable, "-m", "baton", "serve", "--model-path", model_path, "--host", "127.0.0.1",
                           "--port", str(free_port()), "--max-total-tokens", "1024"],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "BATON_TEST_MARK": mark})


@pytest.mark.parametrize("case", ["missing", "no-config"])
def test_a_wrong_model_path_is_one_line_and_exit_2(tmp_path, case):
    path = tmp_path / "model"
    if case == "no-config":
        path.mkdir()
    proc = _serve(str(path), timeout=60)
    assert proc.returncode == 2, proc.stderr
    expected = "no such directory" if case == "missing" else "no config.json"
    assert proc.stderr.strip().startswith("baton serve: error: --model-path") and expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_that_fails_to_load_exits_nonzero_and_leaves_nothing_running(tiny_model_factory, tmp_path):
    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_model_factory("llama"), broken)
    for name in os.listdir(broken):
        if name.endswith(".safetensors"):
            os.remove(broken / name)  # config and tokenizer are there, the weights are not
    mark = uuid.uuid4().hex
    proc = _serve(str(broken), mark)
    assert proc.returncode != 0
    assert "the scheduler failed to start" in proc.stderr and "safetensors" in proc.stderr, proc.stderr[-2000:]
    assert processes_marked(mark) == []
    control = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, "BATON_TEST_MARK": mark})
    try:  # the scan does see a live process carrying the mark (once it has exec'd with its environment)
        deadline = time.monotonic() + 10
        while not processes_marked(mark):
            assert time.monotonic() < deadline, "the control process never showed its mark"
            time.sleep(0.05)
        assert len(processes_marked(mark)) == 1
    finally:
        control.kill()
        control.wait()


@pytest.mark.parametrize("flags,needle", [
    (["--speculative-num-draft-tokens", "5"], "--speculative-num-draft-tokens means nothing without --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "100000"], "more tokens than one step"),
], ids=["without-algorithm", "ngram-past-a-step"])
def test_speculative_flags_that_mean_nothing_are_one_line_and_exit_2(tiny_model_factory, flags, needle):
    """Refused before anything starts, as a wrong path is (both started silently before)."""
    proc = subprocess.run([sys.executable, "-m", "baton", "serve", "--model-path", tiny_model_factory("llama"),
                           "--port", str(free_port()), *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("baton serve: error:") and needle in proc.stderr
    assert "Traceback" not in proc.stderr
