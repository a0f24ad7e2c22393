"""llama.cpp's own `llama-server`, built from the llama.cpp that llama-cpp-python vendors.

The C++ peer must run the same llama.cpp as Blazar, built the same way, or the
benchmark compares two llama.cpp versions instead of two servers. So this script:

1. reads the installed llama-cpp-python's version (the project pins it in pyproject);
2. downloads that version's sdist from PyPI (`pip download --no-binary :all:`);
3. builds only the `llama-server` target of its `vendor/llama.cpp` with CMake, Release,
   with the CPU flags the Makefile gives llama-cpp-python (its exported `CMAKE_ARGS`:
   native, without AMX on x86-64; run outside make, they are read from the Makefile);
4. keeps the binary under `.cache/llama-server/<version>-<key>/`, where the key hashes
   the version, the CMake arguments and the host CPU's feature flags, so only the first
   `make bench` pays the build (about 10 minutes on two cores).

Everything else the server could build is off: tests, examples, the unified app, the
web UI (and its download of prebuilt assets), curl, OpenSSL. The binary is linked
statically against llama.cpp, so it depends on nothing in the build tree.

    python bench/llama_server.py          # build if needed; prints the binary's path

Nothing here runs at daemon or test time: only `bench/` calls it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "llama-server"
DISTRIBUTION = "llama-cpp-python"

# Only the server; nothing that would download anything at build time.
LLAMA_CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
]
TARGET = "llama-server"


def log(message: str) -> None:
    print(f"[llama-server {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pinned_version() -> str:
    """The installed llama-cpp-python's version: the one Blazar's engines run."""
    return version(DISTRIBUTION)


def makefile_cmake_args() -> str:
    """CMAKE_ARGS as the Makefile gives it to llama-cpp-python's build.

    `make` exports it to every recipe, so under `make bench` it is in the environment
    (the user's own CMAKE_ARGS wins there as well, the Makefile sets it with `?=`).
    Run by hand, ask make for the same value rather than keeping a second copy here.
    """
    if "CMAKE_ARGS" in os.environ:
        return os.environ["CMAKE_ARGS"]
    # The recipe prints the exported variable as the shell sees it, quotes intact.
    probe = "print-cmake-args: ; @printf '%s\\n' \"$$CMAKE_ARGS\""
    out = subprocess.run(
        ["make", "--no-print-directory", "-s", "-C", str(REPO), "--eval", probe,
         "print-cmake-args"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return out.stdout.strip()


def cpu_flags() -> str:
    """The host CPU's feature flags: a native build is only good for CPUs that have them."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    return platform.processor()


# Options of the Makefile's CMAKE_ARGS that choose what llama-cpp-python's build makes
# (its lean build turns the server, tools and common library off): not the server's.
_WHAT_TO_BUILD = ("-DLLAVA_BUILD=", "-DLLAMA_BUILD_", "-DLLAMA_CURL=", "-DCMAKE_PROJECT_")


def cmake_arguments(cmake_args: str) -> list[str]:
    """Everything passed to CMake's configure step after -S and -B: the Makefile's
    compiler and CPU flags, then what this build makes (which wins)."""
    flags = [a for a in shlex.split(cmake_args) if not a.startswith(_WHAT_TO_BUILD)]
    return [*flags, *LLAMA_CMAKE_OPTIONS]


def cache_dir(llama_version: str, arguments: list[str]) -> Path:
    key = hashlib.sha256(
        json.dumps([llama_version, arguments, cpu_flags(), platform.machine()]).encode()
    ).hexdigest()[:12]
    return CACHE / f"{llama_version}-{key}"


def binary_path() -> Path:
    """Where the binary for the installed version and the Makefile's flags lives."""
    return cache_dir(pinned_version(), cmake_arguments(makefile_cmake_args())) / TARGET


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """One build at a time per cache (two benches started together build once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def download_sdist(llama_version: str, into: Path) -> Path:
    """The sdist of llama-cpp-python==version from PyPI (pip's HTTP cache may serve it)."""
    into.mkdir(parents=True, exist_ok=True)
    pattern = f"llama[-_]cpp[-_]python-{llama_version}.tar.gz"
    found = sorted(into.glob(pattern))
    if not found:
        log(f"downloading the {DISTRIBUTION}=={llama_version} sdist from PyPI")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             "--no-binary", ":all:", "--dest", str(into),
             f"{DISTRIBUTION}=={llama_version}"],
            check=True,
        )  # fmt: skip
        found = sorted(into.glob(pattern))
    if not found:
        raise RuntimeError(f"pip download left no {pattern} in {into}")
    return found[0]


def unpack(sdist: Path, into: Path) -> Path:
    """The sdist's vendored llama.cpp source tree."""
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    roots = [p for p in into.iterdir() if p.is_dir()]
    if len(roots) != 1:
        raise RuntimeError(f"unexpected sdist layout in {sdist.name}: {roots}")
    source = roots[0] / "vendor" / "llama.cpp"
    if not (source / "tools" / "server").is_dir():
        raise RuntimeError(f"{sdist.name} vendors no llama.cpp server sources at {source}")
    return source


def cmake() -> str:
    """CMake as llama-cpp-python's build finds it: the virtualenv's own, else PATH's."""
    beside = Path(sys.executable).parent / "cmake"
    found = str(beside) if beside.exists() else shutil.which("cmake")
    if found is None:
        raise RuntimeError(
            "cmake is not installed: llama-server needs it to build "
            "(apt-get install cmake, or .venv/bin/pip install cmake)"
        )
    return found


def build(llama_version: str, arguments: list[str], out: Path) -> Path:
    """Configure and build the server; the binary ends up at out/llama-server."""
    started = time.monotonic()
    cmake_bin = cmake()
    sdist = download_sdist(llama_version, CACHE / "sdist")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="build-", dir=CACHE) as scratch:
        source = unpack(sdist, Path(scratch) / "src")
        build_dir = Path(scratch) / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        log(f"configuring {source} with {shlex.join(arguments)}")
        subprocess.run(
            [cmake_bin, "-S", str(source), "-B", str(build_dir), *generator, *arguments],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        log(f"building {TARGET} with {jobs} jobs (about 10 minutes on two cores)")
        subprocess.run(
            [cmake_bin, "--build", str(build_dir), "--target", TARGET, "--parallel", jobs],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        built = build_dir / "bin" / TARGET
        partial = out / f".{TARGET}.partial"
        shutil.copy2(built, partial)
        os.replace(partial, out / TARGET)  # atomic: a reader never sees half a binary
    seconds = time.monotonic() - started
    (out / "build.json").write_text(
        json.dumps(
            {
                "llama_cpp_python": llama_version,
                "cmake_arguments": arguments,
                "build_seconds": round(seconds, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "cpus": os.cpu_count(),
            },
            indent=2,
        )
        + "\n"
    )
    log(f"built {out / TARGET} in {seconds:.0f}s")
    return out / TARGET


def system_info(binary: Path) -> str:
    """The CPU features compiled into the binary, as llama.cpp's `llama_print_system_info`.

    llama-server prints them only at trace verbosity, which the benchmark does not run
    it with; a start without a model prints them and exits at once.
    """
    with tempfile.TemporaryDirectory(prefix="probe-") as scratch:
        out = subprocess.run(
            [str(binary), "--log-verbosity", "4", "--model", str(Path(scratch) / "none.gguf"),
             "--host", "127.0.0.1", "--port", "0"],
            capture_output=True, text=True, timeout=60, cwd=scratch,
        )  # fmt: skip
    for line in (out.stdout + out.stderr).splitlines():
        if "system_info:" in line and "CPU :" in line:
            return "CPU :" + line.split("CPU :", 1)[1].rstrip()
    return ""


def build_record(binary: Path) -> dict[str, object]:
    """What `build` wrote beside the binary: version, CMake arguments, build time."""
    try:
        record: dict[str, object] = json.loads((binary.parent / "build.json").read_text())
    except (OSError, ValueError):
        return {}
    return record


def ensure() -> Path:
    """The llama-server binary for the installed llama-cpp-python, built if missing."""
    llama_version = pinned_version()
    arguments = cmake_arguments(makefile_cmake_args())
    out = cache_dir(llama_version, arguments)
    binary = out / TARGET
    if binary.exists():
        return binary
    with locked(CACHE / ".lock"):
        if binary.exists():  # another process built it while this one waited
            return binary
        return build(llama_version, arguments, out)


def main() -> int:
    print(ensure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
