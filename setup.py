"""Build recipe for the CUDA extension ``xorl_kernels._C`` (metadata lives in pyproject.toml).

When nvcc is found (PATH, then $CUDA_HOME / $CUDA_PATH, then /usr/local/cuda) the extension is built
with CMake from csrc/ and a failed build fails the install, so CI notices a broken kernel. Without
nvcc, or with XORL_SKIP_CUDA_EXT=1, xorl installs as pure Python and every op uses its Triton or
plain-torch path. Works for ``pip install .``, ``pip install -e .`` (PEP 660: setuptools copies the
built module into xorl_kernels/) and ``python setup.py build_ext --inplace``.

Environment knobs: XORL_CUDA_ARCHS (CMake architecture list, default "80;90a"),
XORL_BUILD_JOBS (parallel compile jobs, default: CPU count).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "80;90a"


def find_nvcc() -> str | None:
    if os.environ.get("XORL_SKIP_CUDA_EXT", "0") not in ("", "0"):
        return None
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


class CMakeExtension(Extension):
    """An extension whose sources CMake compiles; setuptools only knows its module name."""

    def __init__(self, name: str, nvcc: str):
        super().__init__(name, sources=[])
        self.nvcc = nvcc


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11  # a build requirement (pyproject.toml [build-system])

        cmake = shutil.which("cmake")
        if cmake is None:
            raise RuntimeError(
                "nvcc was found but cmake was not: install cmake >= 3.24 to build xorl_kernels._C, "
                "or set XORL_SKIP_CUDA_EXT=1 to install without the CUDA extension"
            )
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            cmake,
            "-S",
            str(ROOT),
            "-B",
            str(build_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DCMAKE_CUDA_COMPILER={ext.nvcc}",
            f"-DCMAKE_CUDA_ARCHITECTURES={os.environ.get('XORL_CUDA_ARCHS', DEFAULT_CUDA_ARCHS)}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DXORL_OUTPUT_DIR={target.parent}",
            f"-DXORL_EXT_SUFFIX={sysconfig.get_config_var('EXT_SUFFIX')}",
        ]
        cache = build_dir / "CMakeCache.txt"
        if shutil.which("ninja") and not cache.exists():
            configure += ["-G", "Ninja"]
        jobs = os.environ.get("XORL_BUILD_JOBS", str(os.cpu_count() or 1))
        try:
            subprocess.run(configure, check=True)
            subprocess.run([cmake, "--build", str(build_dir), "--parallel", jobs], check=True)
        except subprocess.CalledProcessError as err:
            raise RuntimeError(
                f"building xorl_kernels._C with {ext.nvcc} failed ({err}); fix the error above, or set "
                "XORL_SKIP_CUDA_EXT=1 to install without the CUDA extension"
            ) from err
        if not target.is_file():
            raise RuntimeError(f"CMake finished but {target} was not produced")


nvcc = find_nvcc()
if nvcc is None:
    print(
        "xorl: nvcc not found (or XORL_SKIP_CUDA_EXT=1): installing without xorl_kernels._C", file=sys.stderr
    )

setup(
    ext_modules=[CMakeExtension("xorl_kernels._C", nvcc)] if nvcc else [],
    cmdclass={"build_ext": CMakeBuild},
)
