"""shared/model/native.py: a kernel includes the shared headers, a header's change rebuilds every kernel (its text
is in the build's name), and the functions come declared as the caller says."""

from __future__ import annotations

import ctypes

import pytest

from shared.model import native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")

SOURCE = '#include "answer.h"\nextern "C" double specdec_answer(double x) { return x * ANSWER; }\n'


def test_a_header_change_rebuilds_and_signatures_are_declared(tmp_path, monkeypatch):
    headers = tmp_path / "headers"
    headers.mkdir()
    monkeypatch.setattr(native, "HEADERS", headers)
    monkeypatch.setenv("SPECDEC_KERNEL_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "answer_kernel.cpp"
    source.write_text(SOURCE)
    signature = {"specdec_answer": ([ctypes.c_double], ctypes.c_double)}

    (headers / "answer.h").write_text("#define ANSWER 2.0\n")
    first = native.build(source, "test kernel", signature)
    assert first is not None and first.specdec_answer(21.0) == 42.0  # a double in and out: declared, not int
    (headers / "answer.h").write_text("#define ANSWER 3.0\n")
    second = native.build(source, "test kernel", signature)
    assert second is not None and second.specdec_answer(21.0) == 63.0
    assert first._name != second._name
    assert len(list((tmp_path / "cache").glob("answer_kernel-*.so"))) == 2
