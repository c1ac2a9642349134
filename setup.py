"""Build glue that pyproject.toml cannot express: ship the interpreter-start bootstrap files.

`src/m3_eagle_plugin.pth` (and its PEP 829 twin `src/m3_eagle_plugin.start`, for Python >= 3.15)
must land at the top of site-packages, outside the package, so they are copied into the wheel root
for regular installs and into the editable wheel for `pip install -e`.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # pragma: no cover - setuptools < 64 has no PEP 660 support
    editable_wheel = None

STARTUP_FILES = ("m3_eagle_plugin.pth", "m3_eagle_plugin.start")
SRC = Path(__file__).parent / "src"


def _copy_startup_files(command, target_dir) -> list:
    outputs = []
    for name in STARTUP_FILES:
        dest = str(Path(target_dir) / name)
        command.copy_file(str(SRC / name), dest)
        outputs.append(dest)
    return outputs


class BuildPyWithStartup(build_py):
    def run(self):
        super().run()
        self._startup_outputs = _copy_startup_files(self, self.build_lib)

    def get_outputs(self, include_bytecode=True):
        return list(super().get_outputs(include_bytecode)) + [
            str(Path(self.build_lib) / name) for name in STARTUP_FILES
        ]


cmdclass = {"build_py": BuildPyWithStartup}

if editable_wheel is not None:

    class EditableWheelWithStartup(editable_wheel):
        def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
            result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
            _copy_startup_files(self, unpacked_wheel)
            return result

    cmdclass["editable_wheel"] = EditableWheelWithStartup

setup(cmdclass=cmdclass)
