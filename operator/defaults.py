"""Structural-schema defaulting, as the API server does it for a CRD.

The API server fills in `default`s of the CRD's openAPIV3Schema when it reads or writes an object; the
operator applies the same defaults itself, so that it behaves identically when talking to a server that
does not (an emulated one, or a CRD installed without defaults). A property's default is applied only
when its parent object exists, and nested defaults are then applied inside it, like the server does.
"""
from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Return a defaulted deep copy of `value` (the input is not modified)."""
    value = copy.deepcopy(value)
    _fill(schema, value)
    return value


def _fill(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, Mapping):
            for key in set(value) - set(props):
                _fill(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        for item in value:
            _fill(schema["items"], item)
