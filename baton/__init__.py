"""Baton: LLM serving with prefill/decode disaggregation on Kubernetes."""

__version__ = "0.1.0"

import os as _os

# `baton.operator` is a namespace package in ../operator (see setup.py), which setuptools' editable
# finder cannot resolve. From a source checkout or an editable install, let the namespace search see
# the repository root too; in a built wheel the folder is inside this package and this does nothing.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "setup.py")) and _os.path.isdir(_os.path.join(_root, "operator")):
    __path__.append(_root)
