"""Which packages the wheel holds; every other setting is in pyproject.toml.

The packages are found on disk (every folder with an `__init__.py`), so a new subpackage cannot be
left out of an install, and the top-level `passes/` and `schemas/` folders install as
`qtransform.passes` and `qtransform.schemas` (the design card's layout: one import namespace, no
top-level `passes` or `schemas` package in site-packages). setuptools' declarative
`packages.find` cannot give found packages a prefix, hence this file.
"""

from setuptools import find_packages, setup

ROOTS = {"qtransform": "qtransform", "qtransform.passes": "passes", "qtransform.schemas": "schemas"}


def packages() -> list[str]:
    """Every package under each root folder, named inside the `qtransform` namespace."""
    return sorted(f"{name}.{sub}" if sub else name
                  for name, folder in ROOTS.items() for sub in ["", *find_packages(folder)])


setup(package_dir=ROOTS, packages=packages())
