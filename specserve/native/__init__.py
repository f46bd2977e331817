"""specserve's own C++ kernels (specserve/native/csrc), built against the installed torch.

Built once by the set-up (`python -m specserve.native`, which `make setup` runs) with the
machine's g++ and ninja, cached under ~/.cache/specserve (or $SPECSERVE_CACHE_DIR), and loaded
by the first model that wants them. Kernels for every CPU level (generic C++, AVX2, AVX-512,
AVX-512 VNNI, AMX tiles for Q8_0 products) are compiled into the one library, each function built for its level with GCC's
target attribute, so one build serves every lower level too; `specserve.hardware` picks the
level at run time. When the compiler is missing or the build fails, specserve runs on the torch
path and says so once; `SPECSERVE_NATIVE=0` asks for the torch path on purpose.

Rules for the sources, which keep one library safe on every CPU: ISA-specific code lives in
files named *_avx2.cpp / *_avx512.cpp / *_amx.cpp that start with `#pragma GCC target(...)` after their
includes, use intrinsics and plain arrays only (no standard-library templates, whose shared
instantiations could otherwise be emitted with the higher ISA and picked by the linker for
generic code), and export plain functions that the generic dispatch code calls only after
checking the level. Everything is compiled with -ffp-contract=off: where a fused multiply-add
is part of a kernel's defined arithmetic it is written out (std::fma or an intrinsic), so every
level computes the same bits.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

CSRC = Path(__file__).parent / "csrc"
NATIVE_ENV = "SPECSERVE_NATIVE"
_FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]


def sources() -> list[Path]:
    return sorted(CSRC.glob("*.cpp"))


def build_dir() -> Path:
    """One folder per torch build and source version: a new torch or edited sources build anew."""
    root = Path(os.environ.get("SPECSERVE_CACHE_DIR", Path.home() / ".cache" / "specserve")).expanduser()
    digest = hashlib.sha256()
    # The folder's build file names the sources by absolute path: two checkouts with equal
    # sources sharing one folder would rebuild each other's kernels on every alternate load.
    digest.update(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(_FLAGS).encode())
    tag = f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-{digest.hexdigest()[:12]}"
    return root / "kernels" / tag.replace("+", "_")


def build(verbose: bool = False) -> ModuleType:
    """Compile (or reuse the cached build of) the extension and import it; raises on failure."""
    from torch.utils import cpp_extension

    folder = build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    clear_stale_lock(folder)
    return cpp_extension.load(name="specserve_native", sources=[str(s) for s in sources()],
                              extra_cflags=_FLAGS, extra_include_paths=[str(CSRC)],
                              build_directory=str(folder), verbose=verbose)


# A build that was killed leaves torch's lock file in its folder, and every later load would wait
# on it forever. No build takes this long (about a minute; a few on a loaded machine).
STALE_LOCK_S = 900.0


def clear_stale_lock(folder: Path) -> None:
    """Remove `folder`'s build lock if it is older than STALE_LOCK_S (a build was interrupted)."""
    lock = folder / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        print(f"specserve: removing a stale kernel build lock ({lock}, {age / 60:.0f} minutes old: a build was "
              "interrupted)", file=sys.stderr)
        lock.unlink(missing_ok=True)


@functools.cache
def load() -> ModuleType | None:
    """The kernels, or None (with the reason in `unavailable_reason()`, printed once)."""
    reason = unavailable_reason()
    if reason is not None:
        if os.environ.get(NATIVE_ENV, "1") != "0":
            print(f"specserve: native kernels unavailable ({reason}); using the torch path", file=sys.stderr)
        return None
    return _built()[0]


@functools.cache
def _built() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(NATIVE_ENV, "1") == "0":
        return None, f"{NATIVE_ENV}=0"
    try:
        return build(), None
    except Exception as e:  # no compiler, no ninja, a compile error: the torch path still works
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return None, f"build failed: {first[:200]}"


def unavailable_reason() -> str | None:
    return _built()[1]
