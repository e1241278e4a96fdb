"""Every architecture is known the same way everywhere: routed by config_utils, built by a
registered model class, prepared by a registered input processor. A name in one table only
(a processor with no model, a route with no class) is a dead entry or a startup crash."""

from __future__ import annotations

import importlib

from tensorrt_llm._torch.config_utils import SUPPORTED_ARCHITECTURES
from tensorrt_llm._torch.models.modeling_auto import import_all_models
from tensorrt_llm.inputs import registry


def test_routes_models_and_processors_name_the_same_architectures() -> None:
    models = set(import_all_models())
    for module in set(registry._LAZY_MODULES.values()):
        importlib.import_module(module)
    processors = set(registry.INPUT_PROCESSOR_REGISTRY)
    routes = set(SUPPORTED_ARCHITECTURES)
    assert processors - models == set(), "input processors without a model class"
    assert models - processors == set(), "model classes without an input processor"
    assert routes ^ models == set(), "config routes and model classes differ"
    assert set(registry._LAZY_MODULES) <= processors
