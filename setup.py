"""The package build's one step beyond pyproject.toml: the CPU kernel library prebuilt for each CPU level.

A wheel then runs its kernels on a machine with no C++ compiler (kernel_library.load picks the best variant the CPU
runs). An editable install (`pip install -e`, `make install`) compiles nothing here: a source tree builds its own
library on first use, from whatever its sources are then.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).parent


class BuildPyWithKernels(build_py):
    """build_py, then the kernel library's variants into the build's llmserve_torch/prebuilt/."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        # the module alone (stdlib only): the package's dependencies need not be installed to build it
        spec = importlib.util.spec_from_file_location(
            "llmserve_kernel_library", ROOT / "plugins" / "llmserve_torch" / "kernel_library.py")
        kl = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = kl  # (its dataclasses look their module up)
        spec.loader.exec_module(kl)
        out = Path(self.build_lib) / "llmserve_torch" / "prebuilt"
        print(f"prebuilding the CPU kernel library's variants into {out} (a minute or two)")
        built = kl.prebuild(out)
        print(f"prebuilt: {', '.join(built) or 'none (no compiler: the library is compiled on first use instead)'}")


class PlatformDistribution(Distribution):
    """The wheel holds compiled libraries: tag it for this platform, not py3-none-any."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyWithKernels}, distclass=PlatformDistribution)
