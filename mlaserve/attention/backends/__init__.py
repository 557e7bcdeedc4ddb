"""The attention backend registry: the router writes a backend's name into each segment, the layer
looks it up here. Names are the config's ATTENTION_BACKENDS (less "auto"). The triton backend's kernel modules are
imported at its first call, not here (platform/triton_runtime.py)."""

from __future__ import annotations

from mlaserve.attention.backends.base import AttentionBackend
from mlaserve.attention.backends.native_backend import NativeBackend
from mlaserve.attention.backends.torch_backend import TorchBackend
from mlaserve.attention.backends.triton_backend import TritonBackend
from mlaserve.attention.reference import ReferenceBackend
from mlaserve.config.machine import ATTENTION_BACKENDS

BACKENDS: dict[str, AttentionBackend] = {
    b.name: b for b in (TorchBackend(), NativeBackend(), TritonBackend(), ReferenceBackend())
}
assert set(BACKENDS) == set(ATTENTION_BACKENDS) - {"auto"}, "registry and config disagree on backend names"


def get_backend(name: str) -> AttentionBackend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; registered: {sorted(BACKENDS)}") from None
