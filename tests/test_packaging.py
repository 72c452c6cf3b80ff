"""The project's top-level import names are its own: no installed distribution besides
llm-cluster provides one. Two distributions with one import name shadow each other by
``sys.path`` order (transformers >= 5.25 installs Hugging Face's ``kernels``, which the old
``kernels`` package of this project hid inside the checkout and was hidden by outside it)."""

from __future__ import annotations

import importlib.metadata

import pytest

PROJECT_PACKAGES = ("llm_kernels", "parallel", "engine", "cluster")


@pytest.mark.parametrize("name", PROJECT_PACKAGES)
def test_no_other_installed_distribution_provides_a_project_package(name: str) -> None:
    providers = set(importlib.metadata.packages_distributions().get(name, []))
    assert providers - {"llm-cluster", "llm_cluster"} == set(), (
        f"the import name {name!r} is also provided by {sorted(providers)}"
    )


def test_transformers_imports_its_activations_beside_the_project() -> None:
    # transformers' activations import its hub-kernels integration, which imports
    # ``kernels`` when that distribution is installed: the first import the old name broke.
    from transformers.activations import ACT2FN

    assert "silu" in ACT2FN
