"""One list of a layer's arguments: `reference`, the dict the native functions take
(`_layer`, behind `plan`, `check`, `save_dump`) and the CUDA entry `index` name the same
ones in the same order, with the same kinds and defaults, so that a layer written for one
is valid for the others."""

import inspect

import pytest

import dsa_indexer as di


def layer_params(f, extras):
    """f's parameters, less its own extras: (name, kind, default) in order."""
    return [
        (name, p.kind, p.default)
        for name, p in inspect.signature(f).parameters.items()
        if name not in extras
    ]


def test_reference_takes_the_layer_arguments():
    assert layer_params(di.reference, {"budget", "logits"}) == layer_params(di._layer, set())


def test_index_takes_the_layer_arguments():
    pytest.importorskip("torch")
    from dsa_indexer import _ops

    extras = {"budget", "out", "precision"}
    assert layer_params(_ops.index, extras) == layer_params(di._layer, set())
