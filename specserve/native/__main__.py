"""`python -m specserve.native`: build (or find cached) the kernels and say what they cover."""

from __future__ import annotations

import sys
import time

from specserve import native


def main() -> int:
    t = time.perf_counter()
    try:
        ext = native.build(verbose="-v" in sys.argv)
    except Exception as e:
        print(f"specserve: native kernels did not build ({e}); specserve will use the torch path", file=sys.stderr)
        return 0 if "--check" not in sys.argv else 1
    from specserve.hardware import machine

    print(f"specserve native kernels ready in {time.perf_counter() - t:.1f}s at {native.build_dir()}; "
          f"compiled levels: {', '.join(ext.compiled_levels())}; this machine: {machine().describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
