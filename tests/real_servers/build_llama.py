"""Build llama-cpp-python once into a cached wheel, then install it (``make real-servers``).

The real-server suite (tests/real_servers/) runs llama-cpp-python's own OpenAI-compatible
server. Its wheel is compiled here from the pinned source distribution, CPU only (no GPU,
no BLAS, no curl, no multimodal library), and kept in a user cache directory
(``$TOUBA_WHEEL_CACHE``, else ``$XDG_CACHE_HOME/touba/wheels``, else
``~/.cache/touba/wheels``; one folder per version and set of build flags): later runs
reuse it, so only the first one pays the build (about 5 minutes on 2 cores). The wheel is
then installed, with the server's own extra, into the interpreter running this script.

When the CPU lacks AVX2, or cmake or a C/C++ compiler is missing, the script says so and
exits 0 with nothing built: the suite then skips with the same reason, except under
``CI=true``, where it fails.

    python tests/real_servers/build_llama.py              # build (or reuse) and install
    python tests/real_servers/build_llama.py --no-install # build (or reuse), print the path
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"  # keep equal to tests/real_servers/_llama.py's LLAMA_CPP_VERSION
# CPU only, for any x86-64 CPU with AVX2 (never -march=native: the cached wheel must not
# carry instructions of the machine that happened to build it); no curl (the server never
# downloads a model here), no BLAS, no GPU backend, no multimodal (mtmd) library, none of
# llama.cpp's own tools, tests or examples.
CMAKE_ARGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_OPENMP=OFF",
    "-DGGML_BLAS=OFF",
    "-DGGML_CUDA=OFF",
    "-DGGML_VULKAN=OFF",
    "-DGGML_METAL=OFF",
    "-DGGML_RPC=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAVA_BUILD=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
)


def cache_dir() -> Path:
    """The user cache directory holding the built wheel: one folder per version and set of
    build flags, so a change of either builds anew instead of reusing a stale wheel."""
    explicit = os.environ.get("TOUBA_WHEEL_CACHE")
    if explicit:
        root = Path(explicit)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = Path(base) / "touba" / "wheels"
    flags = hashlib.sha256("\n".join((VERSION, *CMAKE_ARGS)).encode()).hexdigest()[:12]
    return root / f"llama-cpp-python-{VERSION}-{flags}"


def cached_wheel() -> Path | None:
    """The cached wheel of the pinned version and flags, when one was built."""
    directory = cache_dir()
    if not directory.is_dir():
        return None
    wheels = sorted(directory.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    return wheels[0] if wheels else None


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the suite's llama-cpp-python build, or None."""
    try:
        flags = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return "no /proc/cpuinfo: cannot tell whether the CPU has AVX2 (x86-64 Linux only)"
    if " avx2" not in flags:
        return "the CPU lacks AVX2, which the llama-cpp-python build of the suite needs"
    return None


def missing_build_tool() -> str | None:
    """Why this machine cannot compile llama-cpp-python, or None."""
    for tool in ("cmake", "cc", "c++"):
        if shutil.which(tool) is None:
            return f"{tool!r} is not installed: the llama-cpp-python build needs it"
    return None


def missing_prerequisite() -> str | None:
    """Why this machine cannot build the wheel, or None when it can."""
    return cpu_unsupported() or missing_build_tool()


def build() -> Path:
    """Compile the pinned sdist into the cache directory and return the wheel's path."""
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["CMAKE_ARGS"] = " ".join(CMAKE_ARGS)
    env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
    env["FORCE_CMAKE"] = "1"
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="touba-llama-") as scratch:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "wheel",
                "--no-deps",
                "--no-binary",
                "llama-cpp-python",
                "--wheel-dir",
                scratch,
                f"llama-cpp-python=={VERSION}",
            ],
            check=True,
            env=env,
        )
        built = sorted(Path(scratch).glob(f"llama_cpp_python-{VERSION}-*.whl"))
        if not built:
            raise SystemExit(f"pip built no llama_cpp_python-{VERSION} wheel in {scratch}")
        # Copy, then rename: a build cut halfway never leaves a partial wheel in the cache.
        partial = directory / (built[0].name + ".part")
        shutil.copyfile(built[0], partial)
        target = directory / built[0].name
        partial.replace(target)
    print(f"built {target.name} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def install(wheel: Path) -> None:
    """Install the wheel and its server extra into this interpreter's environment."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", f"{wheel}[server]"],
        check=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-install", action="store_true", help="build or reuse the wheel, print its path"
    )
    args = parser.parse_args(argv)
    wheel = cached_wheel()
    if wheel is None:
        reason = missing_prerequisite()
        if reason is not None:
            print(f"llama-cpp-python not built: {reason}", file=sys.stderr)
            return 0
        wheel = build()
    else:
        print(f"reusing {wheel}", file=sys.stderr)
    if not args.no_install:
        install(wheel)
    print(wheel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
