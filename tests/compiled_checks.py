"""Checks the compiled-artifact tests share: a relative error and equal kept sets per layer."""

from __future__ import annotations

import numpy as np


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def assert_same_kept_sets(rt, eng, what, layers: int = 2):
    for layer in range(layers):
        np.testing.assert_array_equal(np.sort(rt.kept_positions(layer), axis=1),
                                      np.sort(eng.kept_positions(layer).numpy(), axis=1), err_msg=f"{what}, layer {layer}")
