"""The model `mlaserve` runs when none is named.

The trained embedded model (`tiny-dsa/`) is used when it ships in the package; otherwise a tiny
random-weight DeepSeek-V3-layout model is built on first use in the user's cache folder
(~/.cache/mlaserve/random-tiny): it exercises every code path but writes gibberish.
"""

from __future__ import annotations

import os
from pathlib import Path

EMBEDDED = Path(__file__).parent / "tiny-dsa"


def default_model_path() -> Path:
    if (EMBEDDED / "config.json").exists() and (EMBEDDED / "model.safetensors").exists():
        return EMBEDDED
    return build_random_tiny()


def build_random_tiny(folder: Path | None = None) -> Path:
    folder = folder or Path(os.environ.get("MLASERVE_CACHE", Path.home() / ".cache" / "mlaserve")) / "random-tiny"
    if (folder / "model.safetensors").exists():
        return folder
    from mlaserve.embedded.random_model import write_random_model

    folder.mkdir(parents=True, exist_ok=True)
    write_random_model(folder)
    return folder
