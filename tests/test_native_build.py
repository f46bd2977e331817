"""The kernels' build cache: one folder per source tree (path and content), and a build lock
left by an interrupted build does not block later loads forever. Pure Python: nothing compiles."""

import os
import shutil
import time

from specserve import native


def test_each_source_tree_builds_in_its_own_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    here = native.build_dir()
    assert here == native.build_dir()  # stable
    copy = tmp_path / "csrc"
    shutil.copytree(native.CSRC, copy)
    monkeypatch.setattr(native, "CSRC", copy)
    assert native.build_dir() != here  # equal sources elsewhere: ninja's build file names them by path
    (copy / "common.h").write_text((copy / "common.h").read_text() + "\n// edited\n")
    assert len({here, native.build_dir()}) == 2


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / "lock"
    lock.write_text("")
    native.clear_stale_lock(tmp_path)
    assert lock.exists() and capsys.readouterr().err == ""  # a build may be running
    old = time.time() - native.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    native.clear_stale_lock(tmp_path)
    assert not lock.exists() and "stale kernel build lock" in capsys.readouterr().err
    native.clear_stale_lock(tmp_path)  # none left: nothing to do
