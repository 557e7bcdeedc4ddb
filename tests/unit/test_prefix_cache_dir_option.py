"""prefix_cache_dir / prefix_cache_dir_gib: resolved into the cache part, recorded in provenance, bad values
refused naming the option."""

from __future__ import annotations

import pytest
from hf_models import make_config

from mlaserve.config.engine import make_options, resolve
from mlaserve.config.model import ConfigError, ModelConfig


def _config(**opts):
    model = ModelConfig.from_hf(make_config("v3_yarn").to_dict())
    return resolve(model, make_options(device="cpu", **opts), False)


def test_recorded_in_the_cache_part_and_provenance(tmp_path):
    cfg = _config(prefix_cache_dir=str(tmp_path), prefix_cache_dir_gib=0.5)
    assert cfg.cache.prefix_cache_dir == str(tmp_path) and cfg.cache.prefix_cache_dir_gib == 0.5
    got = {s.name: s for s in cfg.provenance}
    assert got["prefix_cache_dir"].value == str(tmp_path) and got["prefix_cache_dir"].source == "user option"
    assert _config().cache.prefix_cache_dir is None


@pytest.mark.parametrize(
    "opts, named",
    [
        (dict(prefix_cache_dir_gib=0), "prefix_cache_dir_gib"),
        (dict(prefix_cache_dir_gib="8"), "prefix_cache_dir_gib"),
        (dict(prefix_cache_dir=""), "prefix_cache_dir"),
        (dict(prefix_cache_dir="d", enable_prefix_caching=False), "enable_prefix_caching"),
        (dict(prefix_cache_dir="d", tensor_parallel_size=2), "tensor_parallel_size"),
    ],
)
def test_bad_values_are_refused(opts, named):
    with pytest.raises(ConfigError, match=named):
        _config(**opts)
