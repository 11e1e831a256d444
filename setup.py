"""Package discovery for the `baton` namespace.

The repository keeps one folder per component at the top level (engine/, router/, operator/), and
each is installed as a subpackage of `baton`. `operator/` has no top-level `__init__.py` on purpose:
with the repository root on sys.path, a regular package there would shadow the standard library's
`operator` module. It is therefore a namespace subpackage (`baton.operator`).
"""
from setuptools import find_namespace_packages, setup

COMPONENTS = {"baton": "baton", "baton.engine": "engine", "baton.router": "router", "baton.operator": "operator"}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in COMPONENTS.items():
        package_dir[name] = folder
        packages.append(name)
        for sub in find_namespace_packages(where=folder, exclude=["*.__pycache__", "__pycache__"]):
            packages.append(f"{name}.{sub}")
    return packages, package_dir


packages, package_dir = _packages()
# The native CPU kernels are compiled from source on first use (engine/kernels/build.py): the .c files
# and the headers they include (tests/test_packaging.py builds them from an installed wheel).
setup(packages=packages, package_dir=package_dir, package_data={"baton.engine.kernels": ["*.c", "*.h"]})
