"""The suite's warnings mean something: `pyproject.toml` makes the warnings that mean a bug (any
UserWarning, the project's included; transformers' deprecated `past_key_values`) errors, so they fail the test that
raised them unless it asserts them. Checked by running pytest, with the project's settings, on a small test file in
a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = '''
import warnings


def test_quiet():
    pass


def test_deprecated_transformers_argument():
    warnings.warn("`past_key_values` is deprecated and will be removed in version 5.40.0", FutureWarning)


def test_user_warning():
    warnings.warn("train.lr=0.001 is far above the rates pretrained encoders are fine-tuned at", UserWarning)


def test_expected_user_warning_asserted():
    import pytest

    with pytest.warns(UserWarning):
        warnings.warn("asserted", UserWarning)
'''


def test_an_unexpected_warning_fails_its_test(tmp_path):
    (tmp_path / "test_cases.py").write_text(CASES)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-c", str(ROOT / "pyproject.toml"),
                           "--rootdir", str(tmp_path), "-n", "0", "-rA", str(tmp_path / "test_cases.py")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    outcome = {line.split("::")[-1].split()[0]: line.split()[0] for line in proc.stdout.splitlines()
               if line.startswith(("PASSED", "FAILED"))}
    expected = {"test_quiet": "PASSED", "test_deprecated_transformers_argument": "FAILED",
                "test_user_warning": "FAILED", "test_expected_user_warning_asserted": "PASSED"}
    assert outcome == expected, proc.stdout[-3000:]
    assert "UserWarning: train.lr=0.001 is far above" in proc.stdout
