"""The metadata lives in setup.cfg; this file maps the repository's folders into one package.

The wheel installs exactly one top-level package, ``trainforge``: the design card's folders trainer/,
callbacks/ and strategies/ become ``trainforge.trainer``, ``trainforge.callbacks`` and
``trainforge.strategies`` (generic top-level names collide with other PyPI packages, such as Coqui's
``trainer``, and with a user's own trainer.py beside their script). Editable installs
(``pip install -e .``) get the same names through setuptools' editable finder.
"""

from setuptools import find_packages, setup

FOLDERS = {
    "trainforge": "trainforge",
    "trainforge.trainer": "trainer",
    "trainforge.callbacks": "callbacks",
    "trainforge.strategies": "strategies",
}
PACKAGES = [
    f"{name}.{sub}" if sub else name for name, folder in FOLDERS.items() for sub in ["", *find_packages(folder)]
]

setup(packages=PACKAGES, package_dir=FOLDERS)
