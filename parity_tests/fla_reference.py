"""FLA itself (fla-core) for the optional comparisons against it (test_fla_layers.py,
test_gsa_layer.py): its layer modules, loaded one file at a time where its package __init__
cannot import (it pulls in every layer and transformers). Skips when FLA is not installed."""
from __future__ import annotations

import importlib
import sys
import types
import warnings

import pytest


def fla_layer_module(name: str):
    """fla.layers.<name>, or skip. fla/layers/__init__ imports every FLA layer (and
    transformers); when that fails, the one layer file is loaded on its own."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(f"fla.layers.{name}")
    except ImportError:
        pass
    try:
        fla = importlib.import_module("fla")
    except Exception as e:      # noqa: BLE001 (any failure means: FLA is not usable here)
        pytest.skip(f"optional comparison against FLA itself: fla-core is not installed ({e}); "
                    f"pip install fla-core to run it")
    if "fla.layers" not in sys.modules:
        pkg = types.ModuleType("fla.layers")
        pkg.__path__ = [f"{fla.__path__[0]}/layers"]
        sys.modules["fla.layers"] = pkg
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(f"fla.layers.{name}")
    except Exception as e:      # noqa: BLE001
        pytest.skip(f"optional comparison against FLA itself: its fla.layers.{name} does not "
                    f"import here ({e})")
