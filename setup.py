"""Builds the optional compiled hot path (see cdc/speedups.py).

Where Cython or a C compiler is missing, the extensions are skipped with a
warning and the package installs as pure Python, which works the same, slower.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCES = {"cdc.bridge._changes": "cdc/bridge/_changes.pyx", "cdc.sink._resp": "cdc/sink/_resp.pyx",
           "cdc.sink._entries": "cdc/sink/_entries.pyx"}


class OptionalBuildExt(build_ext):
    """build_ext that warns instead of failing: the pure-Python modules stand in."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # no compiler at all
            self.warn(f"compiled hot path not built ({exc}); cdc runs as pure Python")

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self.warn(f"{ext.name} not built ({exc}); cdc runs it as pure Python")


def extensions() -> list[Extension]:
    try:
        from Cython.Build import cythonize
    except ImportError:
        return []
    modules = [Extension(name, [path], extra_compile_args=["-O2"]) for name, path in SOURCES.items()]
    return cythonize(modules, compiler_directives={"language_level": 3}, quiet=True)


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
